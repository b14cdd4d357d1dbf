"""A rank of the reused test world: started once per world size under mpiexec by tests/_harness.py.

It starts the mp_comm world once, then runs the functions the pytest process sends, one at a time,
each called as fn(world, *args, **kwargs), and sends back the result or the formatted traceback.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _reset_facade() -> None:
    # Tests that go through `smp.init` leave the facade's state behind; clear it between tasks.
    facade = sys.modules.get("mp")
    reset = getattr(facade, "reset", None)
    if callable(reset):
        reset()


def main() -> None:
    host, port, authkey = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    from mp_comm.world import init_world

    world = init_world()
    conn = Client((host, port), authkey=authkey)
    # The harness sends SIGUSR1 to a rank that does not answer in time: every thread's stack goes to
    # stderr, so a hang is reported with where each rank was stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn.send(("ready", world.rank, os.getpid()))
    while True:
        task = pickle.loads(conn.recv_bytes())
        if task is None:
            break
        task_id, module, qualname, args, kwargs = task
        try:
            result = _resolve(module, qualname)(world, *args, **kwargs)
            reply = (task_id, "ok", result)
        except BaseException:
            reply = (task_id, "error", traceback.format_exc())
        try:
            _reset_facade()
        except BaseException:
            reply = (task_id, "error", "reset after the task failed:\n" + traceback.format_exc())
        # Plain pickle, not multiprocessing's: that one shares tensor storage through file
        # descriptors, which cannot cross to a process that was not forked from this one.
        try:
            data = pickle.dumps(reply)
        except Exception:
            data = pickle.dumps(
                (task_id, "error", "the result could not be pickled:\n" + traceback.format_exc())
            )
        conn.send_bytes(data)
    conn.close()
    world.shutdown()


if __name__ == "__main__":
    main()
