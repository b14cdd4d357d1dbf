"""A process outside the job that reaches a rank's UCX worker (tests/mp_comm/test_transport_ucx_auth.py).

No rank listens for connections, so it is handed the rank's worker address (hex, argv[1]), as if it
had stolen it. It introduces itself as rank 1 without the job's secret, sends a header and a control
message whose bytes are a pickle that creates the folder named by MP_FOREIGN_MARKER when unpickled,
and a control message far longer than any the job sends.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import numpy as np

from mp_comm.transport.ucx import _CTRL, _HEADER, _tag, import_ucxx
from mp_comm.transport.ucx_wire import _HELLO


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (os.environ["MP_FOREIGN_MARKER"],)


def main() -> None:
    address = np.frombuffer(bytes.fromhex(sys.argv[1]), dtype=np.uint8)
    ucx, array = import_ucxx()
    worker = ucx.UCXWorker(ucx.UCXContext(feature_flags=(ucx.Feature.TAG,)))
    ep = ucx.UCXEndpoint.create_from_worker_address(worker, ucx.UCXAddress.create_from_buffer(address), True)
    hello = np.zeros(40, dtype=np.uint8)
    hello[:8] = np.frombuffer(np.int64(1).tobytes(), dtype=np.uint8)
    evil = np.frombuffer(bytearray(pickle.dumps(Payload())), dtype=np.uint8)
    flood = np.zeros(1 << 20, dtype=np.uint8)
    reqs = [
        ep.tag_send(array(hello), ucx.UCXXTag(_tag(_HELLO, 1, 0))),
        ep.tag_send(array(evil), ucx.UCXXTag(_tag(_HEADER, 1, 0))),
        ep.tag_send(array(evil), ucx.UCXXTag(_tag(_CTRL, 1, 0))),
        ep.tag_send(array(flood), ucx.UCXXTag(_tag(_CTRL, 1, 1))),
    ]
    deadline = time.monotonic() + 20
    while not all(r.completed for r in reqs) and time.monotonic() < deadline:
        worker.progress()
        time.sleep(1e-3)
    print("sent", all(r.completed for r in reqs), flush=True)
    time.sleep(0.5)


if __name__ == "__main__":
    main()
