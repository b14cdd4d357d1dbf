"""The UCX transport tests' shared pieces: the quick transport config, whether UCX can run here, two
transports on threads of one process."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

from mp_comm.errors import TransportUnavailableError
from mp_comm.transport import ThreadBootstrap, TransportConfig
from mp_comm.transport.ucx import UCXConfig, UCXTransport, import_ucxx

FAST = TransportConfig(timeout=20.0)
D2D_ON_CPU = UCXConfig(
    buffered_devices=("cpu",), buffered_peers="all", recv_buffer_bytes=1 << 20, send_buffer_bytes=1 << 20
)


@functools.cache
def ucx_problem() -> str | None:
    """Why UCX cannot run here (None when it can): missing ucxx, or a worker that does not start."""
    try:
        import_ucxx()
        t = UCXTransport(ThreadBootstrap.group(1)[0], config=FAST)
    except TransportUnavailableError as exc:
        return str(exc)
    t.close()
    return None


# a string condition: pytest evaluates it in the test module, which must import ucx_problem too
needs_ucx = pytest.mark.skipif("ucx_problem() is not None", reason="ucxx is missing or cannot start here")


def in_threads(fn: Any, n: int) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    return results


def ucx_pair(ucx: UCXConfig | None = None, config: TransportConfig = FAST) -> list[UCXTransport]:
    boot = ThreadBootstrap.group(2)
    return in_threads(lambda r: UCXTransport(boot[r], config=config, ucx=ucx, node_key="n"), 2)


def close_all(ts: list[UCXTransport]) -> None:
    in_threads(lambda r: ts[r].close(), len(ts))


def ucx_conflict() -> str | None:
    # In a rank where MPI loaded the mpich wheel's own UCX first, ucxx cannot load (see
    # ucx.preload_before_mpi); the world was started by code outside this module.
    try:
        import_ucxx()
    except TransportUnavailableError as exc:
        return str(exc)
    return None
