"""A config that only some ranks can refuse stops every rank at smp.init, naming the rank and the key.

rank 0 alone writes ``partition_file``, so only rank 0 can see that its folder is missing; before the
check moved to smp.init, the job trained until the first step's partitioning and failed there. The
other ranks learn of rank 0's refusal before any process group exists and stop with its reason.
"""

from __future__ import annotations

from pathlib import Path

from tests._harness import run_script


def test_a_partition_file_folder_missing_on_rank_0_stops_every_rank_at_init(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    missing = tmp_path / "no-such-folder" / "partition.json"
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "partition_file": str(missing)}
    script.write_text(f"import mp as smp\nsmp.init({config!r})\nprint('initialized', flush=True)\n")
    output, code, took = run_script(script, 2, timeout=120)
    assert code != 0, output
    assert "initialized" not in output, output
    assert "ConfigError: config key 'partition_file'" in output and "does not exist" in output, output
    assert "rank 0 of 2 refused to start, so this rank (1) stops too" in output, output
    assert took < 60, f"the job took {took:.0f} s to stop"
