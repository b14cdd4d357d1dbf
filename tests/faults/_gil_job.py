"""A 2-rank smp job whose rank 1 holds the GIL in one C call for a minute (tests/faults/test_heartbeat.py).

ctypes.PyDLL calls keep the GIL (ctypes.CDLL's release it), so libc's sleep through it stops every
Python thread of rank 1, its heartbeat included, while the process runs: what a C extension that never
releases the GIL does.
"""

from __future__ import annotations

import ctypes
import time

import mp as smp


def hold_the_gil_in_one_c_call() -> None:
    ctypes.PyDLL(None).sleep(60)


smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
print(f"rank {smp.rank()} started", flush=True)
smp.barrier()
if smp.rank() == 1:
    hold_the_gil_in_one_c_call()
else:
    time.sleep(60)
