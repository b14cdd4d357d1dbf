"""Only the job's ranks are heard: a foreign process on a rank's UCX port runs nothing (transport/auth.py).

The foreign process introduces itself as rank 1 and sends a header and a control message made of a
pickle that would create a folder when unpickled. The rank drops them unread, counts them, and the
job's own ranks keep talking.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_comm.transport import auth
from tests.mp_comm._foreign_ucx import Payload
from tests.mp_comm.test_transport_ucx import _close, _pair, _ucx_problem  # noqa: F401 (the skip reads it)

FOREIGN = Path(__file__).with_name("_foreign_ucx.py")
needs_ucx = pytest.mark.skipif("_ucx_problem() is not None", reason="ucxx is missing or cannot start here")


def test_sealed_messages_open_only_with_the_secret_and_their_tag() -> None:
    secret, other = auth.new_secret(), auth.new_secret()
    sealed = auth.seal(secret, 7, b"header")
    assert auth.unseal(secret, 7, sealed) == b"header"
    assert auth.unseal(other, 7, sealed) is None  # another job's secret
    assert auth.unseal(secret, 8, sealed) is None  # replayed under another tag (sender, message)
    assert auth.unseal(secret, 7, sealed[:-1] + bytes([sealed[-1] ^ 1])) is None
    assert auth.unseal(secret, 7, b"short") is None
    assert auth.open_hello(secret, auth.hello(secret, 3)) == 3
    assert auth.open_hello(secret, bytes(auth.HELLO_BYTES)) is None


@needs_ucx
def test_a_foreign_process_with_a_crafted_pickle_runs_nothing(tmp_path: Path) -> None:
    # The payload is live: unpickled, it creates its folder (what an unchecked header would do).
    control = tmp_path / "control"
    os.environ["MP_FOREIGN_MARKER"] = str(control)
    try:
        pickle.loads(pickle.dumps(Payload()))
    finally:
        del os.environ["MP_FOREIGN_MARKER"]
    assert control.is_dir()

    a, b = _pair()
    marker = tmp_path / "pwned"
    try:
        proc = subprocess.run(
            [sys.executable, str(FOREIGN), str(a._peers[0][1])],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MP_FOREIGN_MARKER": str(marker)},
        )
        assert "sent True" in proc.stdout, proc.stdout + proc.stderr
        deadline = time.monotonic() + 20
        while a.rejected < 3 and time.monotonic() < deadline:  # the hello, the header, the control
            time.sleep(0.05)
        assert a.rejected >= 3, a.rejected
        assert not marker.exists(), "the foreign pickle was unpickled"
        # the job carries on: rank 1's real messages still arrive
        b.send({"step": 1}, 0, tag="after")
        assert a.recv(1, "after", timeout=20).obj == {"step": 1}
    finally:
        _close([a, b])
