#!/usr/bin/env bash
# The device suite's environment, then the suite (benchmarks/device_suite.py; issue 41 item 5).
#
#   bash benchmarks/device_suite.sh OUT_DIR [device_suite.py options]
#
# Run from anywhere; works in the repository's root. Wheels in .whl/ (mpi4py, and the mpich wheel whose
# MPICH the ranks use) are installed to /tmp/mp_site and /tmp/mp_mpich first: the device machine has
# no network, and a system MPI beside them (see docs/gpu.md). mp's six packages are imported from
# packages/*/src (nothing needs an installed entry point: the benchmarks start their ranks themselves).
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/device_suite.sh OUT_DIR [options]}
shift
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    rm -rf /tmp/mp_site /tmp/mp_mpich
    wheels=$(ls .whl/*.whl | grep -v '/mpich-')
    if [ -n "$wheels" ]; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mp_site $wheels || exit 1
        export PYTHONPATH=/tmp/mp_site${PYTHONPATH:+:$PYTHONPATH}
    fi
    mpich_whl=$(ls .whl/mpich-*.whl 2>/dev/null | head -n 1)
    if [ -n "$mpich_whl" ]; then
        # pip --target drops the wheel's lib/ (libmpi); unpack it whole instead
        $py -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/mp_mpich')" "$mpich_whl" || exit 1
        mpich=$(ls -d /tmp/mp_mpich/mpich-*.data/data)
        chmod +x "$mpich"/bin/*
        export PATH="$mpich/bin:$PATH"
        export LD_LIBRARY_PATH="$mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI="$mpich/lib/libmpi.so.12"
        export MP_BENCH_MPIEXEC="$mpich/bin/mpiexec"
    fi
fi
src=$(ls -d "$PWD"/packages/*/src | paste -sd: -)
export PYTHONPATH="$src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "device suite: $($py --version), $(command -v mpiexec), $(nproc) CPUs"
$py -c "import torch, mpi4py; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'mpi4py', mpi4py.__version__, mpi4py.__file__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
exec $py -m benchmarks.device_suite --out "$out" "$@"
