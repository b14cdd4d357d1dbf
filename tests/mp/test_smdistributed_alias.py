"""``import smdistributed.modelparallel.torch as smp`` gives mp, and never shadows a real smdistributed.

Each import runs in a fresh interpreter (the alias changes sys.meta_path and sys.modules).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests._harness import run_script

ROOT = Path(__file__).resolve().parents[2]
SHIM_SRC = ROOT / "packages" / "mp" / "src"


def _python(code: str, cwd: Path, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("MP_SMDISTRIBUTED_ALIAS", "PYTHONPATH")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=environ,
    )


def _fake_real_install(where: Path, *, namespace: bool = False) -> Path:
    """A stand-in for the real smdistributed-modelparallel wheel's files."""
    pkg = where / "smdistributed" / "modelparallel"
    (pkg / "torch").mkdir(parents=True)
    if not namespace:
        (where / "smdistributed" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '1.12.1'\nREAL = True\n")
    (pkg / "torch" / "__init__.py").write_text("REAL = True\n")
    return pkg


def test_the_import_path_is_mp_itself(tmp_path: Path) -> None:
    proc = _python(
        """
        import importlib, os
        import smdistributed.modelparallel.torch as smp
        import mp
        from packaging import version
        from smdistributed.modelparallel import __version__ as SMP_VERSION

        assert smp is mp, smp
        assert SMP_VERSION == "1.15.0", SMP_VERSION
        assert version.parse(SMP_VERSION) >= version.parse("1.10")  # transformers' and scripts' test
        names = {
            "nn": mp.nn, "amp": mp.amp, "model": mp.model, "optimizers": mp.optimizers,
            "state_mod": importlib.import_module("mp.state"), "exceptions": mp.errors,
            "optimizers.optimizer": importlib.import_module("mp.optimizer"), "nn.utils": mp.nn.utils,
        }
        for sub, module in names.items():
            got = importlib.import_module("smdistributed.modelparallel.torch." + sub)
            assert got is module, (sub, got, module)
        from smdistributed.modelparallel.torch.state_mod import state
        from smdistributed.modelparallel.torch.nn import FusedLayerNorm, DistributedTransformerLMHead
        from smdistributed.modelparallel.torch.optimizers import FusedAdam, FusedLAMB
        from smdistributed.modelparallel.torch.optimizers.optimizer import DistributedOptimizer
        assert state is mp.state and smp.state is state and type(state).__name__ == "State"
        assert smp.model.DistributedModel is mp.DistributedModel  # transformers' isinstance check
        assert mp.model.__spec__.name == "mp.model"  # mp's modules keep their own identity
        for name, expected in (("state", "a State, not a module"), ("smplib", "mp has no 'mp.smplib'")):
            try:
                importlib.import_module("smdistributed.modelparallel.torch." + name)
            except ModuleNotFoundError as exc:
                assert expected in str(exc), exc
            else:
                raise AssertionError(name)
        assert type(mp.state).__name__ == "State"  # the refused import left smp.state alone

        os.environ["SM_HP_MP_PARAMETERS"] = '{"partitions": 2}'
        os.environ["SM_FRAMEWORK_PARAMS"] = '{"sagemaker_mpi_enabled": true}'
        from transformers.utils import is_sagemaker_mp_enabled
        assert is_sagemaker_mp_enabled()
        print("ALIAS OK")
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and "ALIAS OK" in proc.stdout, proc.stdout + proc.stderr


def _documented_names() -> dict[str, str]:
    """Each name docs/migrating.md says the alias serves under smdistributed.modelparallel.torch, and
    the mp module it is (from the bullets of 'What the alias does')."""
    text = (ROOT / "docs" / "migrating.md").read_text()
    served = re.search(r"is mp's `mp\.X` \(([^)]*)\)", text)
    renamed = re.findall(r"`([\w.]+)` → `mp\.([\w.]+)`", text)
    assert served is not None and renamed, "docs/migrating.md no longer lists the alias's names"
    names = {name: "mp." + name for name in re.findall(r"`([\w.]+)`", served[1])}
    names.update({name: "mp." + target for name, target in renamed})
    assert {"nn", "amp", "state_mod", "exceptions", "optimizers.optimizer"} <= set(names), names
    return names


@pytest.mark.parametrize("form", ["from", "import"])
def test_every_documented_name_imports_in_both_forms(tmp_path: Path, form: str) -> None:
    # One fresh interpreter per form: `import a.b.c` binds c on a.b, after which `from a.b import c`
    # would pass whether or not it works on its own. The names do not bind one another.
    names = _documented_names()
    proc = _python(
        f"""
        import importlib
        failed = []
        for name, target in {names!r}.items():
            parent, _, leaf = ("smdistributed.modelparallel.torch." + name).rpartition(".")
            try:
                space = {{}}
                if {form!r} == "from":
                    exec(f"from {{parent}} import {{leaf}} as got", space)
                else:
                    exec(f"import {{parent}}.{{leaf}} as got", space)
                got = space["got"]
            except ImportError as exc:
                failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
                continue
            if got is not importlib.import_module(target):
                failed.append(f"{{name}}: got {{got!r}}, expected {{target}}")
        print("FAILED", failed) if failed else print("NAMES OK", len({names!r}))
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and "NAMES OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("namespace", [False, True])
def test_a_real_install_before_the_alias_is_the_one_imported(tmp_path: Path, namespace: bool) -> None:
    _fake_real_install(tmp_path / "site", namespace=namespace)
    proc = _python(
        """
        import smdistributed.modelparallel.torch as smp
        import smdistributed.modelparallel as m
        assert getattr(smp, "REAL", False) and m.__version__ == "1.12.1", (smp, m)
        print("REAL OK")
        """,
        tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site")},  # PYTHONPATH precedes site-packages and .pth entries
    )
    assert proc.returncode == 0 and "REAL OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_real_install_after_the_alias_is_never_shadowed_silently(tmp_path: Path) -> None:
    real = _fake_real_install(tmp_path / "site", namespace=True)
    code = f"""
        import sys
        sys.path.append({str(tmp_path / "site")!r})  # after mp's src: the alias comes first
        from mp.errors import RealSmdistributedError
        try:
            import smdistributed.modelparallel.torch as smp
        except RealSmdistributedError as exc:
            print("REFUSED", exc)
        else:
            import mp
            print("USED MP" if smp is mp else "OTHER")
        """
    refused = _python(code, tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 0 and "REFUSED" in refused.stdout, out
    assert str(real) in out and "MP_SMDISTRIBUTED_ALIAS=1" in out and "pip uninstall" in out, out
    forced = _python(code, tmp_path, env={"MP_SMDISTRIBUTED_ALIAS": "1"})
    out = forced.stdout + forced.stderr
    assert forced.returncode == 0 and "USED MP" in forced.stdout, out
    assert "would shadow it; using mp because MP_SMDISTRIBUTED_ALIAS=1" in out, out


def test_a_real_install_known_only_by_its_metadata_is_refused(tmp_path: Path) -> None:
    info = tmp_path / "meta" / "smdistributed_modelparallel-1.15.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: smdistributed-modelparallel\nVersion: 1.15.0\n"
    )
    proc = _python(
        f"""
        import sys
        sys.path.append({str(tmp_path / "meta")!r})
        import smdistributed.modelparallel
        """,
        tmp_path,
    )
    assert proc.returncode != 0, proc.stdout
    assert "RealSmdistributedError" in proc.stderr and "smdistributed-modelparallel 1.15.0" in proc.stderr


@pytest.mark.slow
def test_the_wheel_installs_the_alias_beside_site_packages(tmp_path: Path) -> None:
    """The built wheel puts the shim in a folder of its own that its .pth appends to sys.path: a real
    smdistributed in site-packages keeps its files and wins; without one the alias serves the import."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "w"),
            str(SHIM_SRC.parent),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "w").glob("mp-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(site)
    assert (
        "mp_smdistributed.pth" in names
        and "mp_smdistributed/smdistributed/modelparallel/__init__.py" in names
    )
    assert not any(n.startswith("smdistributed/") for n in names), names  # no file of a real install's
    code = f"""
        import site, sys
        sys.path[:] = [p for p in sys.path if not p.startswith({str(SHIM_SRC)!r})]  # not the editable mp
        site.addsitedir({str(site)!r})  # what the interpreter does for site-packages: reads the .pth
        import smdistributed.modelparallel.torch as smp
        print("FROM", smp.__file__, getattr(smp, "REAL", False))
        """
    alone = _python(code, tmp_path)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert f"FROM {site / 'mp'}" in alone.stdout and "False" in alone.stdout, alone.stdout
    _fake_real_install(site)  # a real install in the same site-packages
    both = _python(code, tmp_path)
    assert both.returncode == 0 and "True" in both.stdout, both.stdout + both.stderr


SCRIPT = """
import copy

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn.functional as F
from torch import nn

smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
reference = copy.deepcopy(net)
model = smp.DistributedModel(net, trace_device="gpu")
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
assert smp.num_microbatches() == 2
assert model.size() == sum(p.numel() * 4 for p in reference.parameters())


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


for i in range(3):
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    loss = train_step(model, x, y).reduce_mean()
    optimizer.step()
    optimizer.zero_grad()
    # plain PyTorch on the whole batch: the mean of the two microbatches' losses
    ref_loss = sum(F.mse_loss(reference(x[k : k + 4]), y[k : k + 4]) for k in (0, 4)) / 2
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()
    assert torch.allclose(loss, ref_loss.detach(), atol=1e-6), (i, loss, ref_loss)
full = model.state_dict()
if smp.rank() == 0:
    for k, v in reference.state_dict().items():
        assert torch.allclose(full[k], v, atol=1e-6), k
print(f"rank {smp.rank()}: smp script OK", flush=True)
"""


def test_an_smp_script_runs_unchanged_under_mpiexec(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    output, code, _ = run_script(script, 2, env={"MP_SMDISTRIBUTED_ALIAS": ""})
    assert code == 0, output
    assert "rank 0: smp script OK" in output and "rank 1: smp script OK" in output, output


def test_another_copy_of_mps_own_alias_is_not_a_real_install(tmp_path: Path) -> None:
    """An editable install gets the wheel's copy too (site-packages/mp_smdistributed): not a conflict."""
    copy = tmp_path / "mp_smdistributed" / "smdistributed"
    shutil.copytree(SHIM_SRC / "smdistributed", copy)
    proc = _python(
        f"""
        import sys
        sys.path.append({str(copy.parent)!r})
        import smdistributed.modelparallel.torch as smp
        import mp
        assert smp is mp
        print("ONE MP")
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and "ONE MP" in proc.stdout, proc.stdout + proc.stderr
