"""Development sessions for the mp monorepo.

`nox -s tests` is what CI runs (through .ci/run). Each package also has a session that installs only
that package and what it declares, in a fresh venv, and runs its own tests: the proof that the packages
stand alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
# py-spy: a multi-rank job that does not end fails with every rank's stacks (tests/_harness.run_job)
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "py-spy>=0.3.14")

# distribution -> (import name, local distributions it depends on, extra test-only requirements)
PACKAGES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "mp-comm": ("mp_comm", (), ()),
    "mp-partition": ("mp_partition", (), ("transformers>=4.40", "matplotlib>=3.7")),
    "mp-pipeline": ("mp_pipeline", ("mp-comm", "mp-partition"), ()),
    "mp-tensor": ("mp_tensor", ("mp-comm",), ("transformers>=4.40",)),
    "mp-memory": ("mp_memory", ("mp-comm",), ()),
    "mp": (
        "mp",
        ("mp-comm", "mp-partition", "mp-pipeline", "mp-tensor", "mp-memory"),
        ("transformers>=4.40",),
    ),
}
ALL_TEST_EXTRAS = ("transformers>=4.40", "accelerate>=1.0", "matplotlib>=3.7", "tqdm>=4.66")

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = os.environ.get("CI") is None


def _editable(*dists: str) -> list[str]:
    args: list[str] = []
    for dist in dists:
        args += ["-e", str(ROOT / "packages" / dist)]
    return args


def _install_all(session: nox.Session, *extra: str) -> None:
    # mp-comm[ucx] too, so that the UCX transport's tests run for real (over tcp/shared memory on CPU).
    ucx = ("-e", f"{ROOT / 'packages' / 'mp-comm'}[ucx]")
    session.install(*CONSTRAINTS, *_editable(*PACKAGES), *ucx, *TEST_TOOLS, *ALL_TEST_EXTRAS, *extra)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole suite, every package installed editable with the CPU torch pinned."""
    _install_all(session)
    args = session.posargs or ["tests"]
    # the 25 slowest tests in the log: the suite runs on a CI budget (~20 min on 2 cores)
    session.run("python", "-m", "pytest", "--durations=25", *args, env={"MP_TEST_SUITE": "full"})


def _make_package_session(dist: str) -> None:
    import_name, local_deps, test_extra = PACKAGES[dist]

    @nox.session(name=f"pkg-{dist}", python="3.11")
    def package_tests(session: nox.Session) -> None:
        # No reuse: the point is a venv holding this package and what it declares, nothing else.
        session.install(*CONSTRAINTS, *_editable(*local_deps, dist), *TEST_TOOLS, *test_extra)
        if dist == "mp-partition":
            session.run(
                "python",
                "-c",
                "import importlib.util, sys; import mp_partition; "
                "sys.exit('mpi4py was installed with mp-partition alone' "
                "if importlib.util.find_spec('mpi4py') else 0)",
            )
        session.run("python", "-c", f"import {import_name}")
        session.run("python", "-m", "pytest", f"tests/{import_name}", *session.posargs, success_codes=[0, 5])

    package_tests.__doc__ = f"Install only {dist} (and what it declares) and run tests/{import_name}."


for _dist in PACKAGES:
    _make_package_session(_dist)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff over the tree, mypy --strict over every package's src/, and the packages' layering
    (import-linter, the contracts in pyproject.toml)."""
    _install_all(session, "ruff>=0.5", "mypy>=1.10", "import-linter>=2.0")
    session.run("lint-imports")
    session.run("ruff", "check", "packages", "tests", "benchmarks", "noxfile.py", "examples")
    session.run("ruff", "format", "--check", "packages", "tests", "benchmarks", "noxfile.py", "examples")
    srcs = [str(ROOT / "packages" / d / "src") for d in PACKAGES]
    session.run("mypy", "--strict", *srcs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: a real multi-process run on this machine (4 ranks under mp-launch)."""
    _install_all(session)
    session.run("mp-launch", "-n", "4", str(ROOT / "examples" / "demo.py"), *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/ (not part of the test suite); results go to benchmarks/results/."""
    _install_all(session)
    session.run("python", "-m", "benchmarks.run", *session.posargs)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build docs/ with Sphinx, warnings as errors. The API reference imports mp (and mp.hf_trainer,
    transformers); the compatibility table is rendered from mp.compat (docs/conf.py)."""
    docs_deps = ("transformers>=4.40", "accelerate>=1.0", "sphinx>=7", "myst-parser>=3")
    session.install(*CONSTRAINTS, *_editable(*PACKAGES), *docs_deps)
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")
