"""mp's entries in a state dict (mp_memory.checkpoint.schema): written and read back as typed records,
type-checked, and read from the forms older mp wrote."""

from __future__ import annotations

import pytest

from mp_memory.checkpoint.errors import CheckpointCorruptError
from mp_memory.checkpoint.schema import KEYS, Header, SDPLayout, TPLayout, read_header, write_header


def test_a_header_round_trips_and_leaves_the_state_alone() -> None:
    header = Header(
        partial=True,
        partition={"a": 0, "b": 1},
        param_names=[["a.w", None]],
        tp_layout=TPLayout(2, 1, 2, 0, {"a.w": 0}),
        sdp_layout=SDPLayout(2, 1, tp_rank=0),
        zero_param_names=["a.w"],
        precision="bf16",
    )
    state = {"a.w": 1, "state": {}, "param_groups": []}
    written = write_header(state, header)
    assert set(written) - set(state) == {
        KEYS[k]
        for k in (
            "partial",
            "partition",
            "param_names",
            "tp_layout",
            "sdp_layout",
            "zero_param_names",
            "precision",
        )
    }
    assert read_header(written) == (header, state)
    assert write_header(state, Header()) == state  # the defaults are written as absent


def test_the_sdp_layout_older_mp_kept_under_the_tp_layout_key_is_read_as_one() -> None:
    old = {"w": 0, "_smp_is_partial": True, "_smp_layout": {"sdp_degree": 2, "sdp_shard": 1}}
    header, rest = read_header(old)
    assert header == Header(partial=True, sdp_layout=SDPLayout(2, 1)) and rest == {"w": 0}
    again = write_header(rest, header)
    assert "_smp_layout" not in again and again["_mp_sdp_layout"] == {"sdp_degree": 2, "sdp_shard": 1}


@pytest.mark.parametrize(
    "entry",
    [
        {"_smp_is_partial": "yes"},
        {"_smp_layout": {"pp": 1}},
        {"_mp_precision": 16},
        {"_smp_something_new": True},
    ],
    ids=str,
)
def test_entries_mp_did_not_write_are_refused_by_name(entry: dict[str, object]) -> None:
    with pytest.raises(CheckpointCorruptError, match=next(iter(entry))):
        read_header({"w": 0, **entry})
