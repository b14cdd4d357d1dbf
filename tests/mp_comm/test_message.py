"""The message format: stubs, metadata, exact round trips of every dtype and layout, static caches.

Round trips go through the loopback transport, which takes the full path of the real transports
(pickling with stubs, header bytes, receiver-side allocation, payload copy) inside one process.
"""

from __future__ import annotations

import collections
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_comm.errors import MessageDecodeError, MessageEncodeError
from mp_comm.message import (
    PROTOCOL_VERSION,
    Header,
    MetaCacheReceiver,
    MetaCacheSender,
    TensorMeta,
    allocate,
    byte_view,
    decode_header,
    decode_object,
    encode_header,
    encode_object,
    is_dense,
    numpy_bytes,
    wire_tensors,
)
from mp_comm.transport.base import TransportConfig
from mp_comm.transport.loopback import LoopbackHub
from tests.mp_comm._payloads import ALL_DTYPES, BoomOnLoad, Pair, bitwise_equal, sample_tensor


def _roundtrip(obj: Any, **config: Any) -> Any:
    hub = LoopbackHub(2, config=TransportConfig(timeout=5.0, **config))
    a, b = hub.transport(0), hub.transport(1)
    try:
        a.send(obj, 1, "m").wait()
        source, tag, got = b.recv(0, "m")
        assert (source, tag) == (0, "m")
        return got
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("inline", [0, 4096], ids=["separate", "inline"])
def test_every_dtype_round_trips_bit_exactly(dtype: torch.dtype, inline: int) -> None:
    for shape in [(), (0,), (3, 0, 2), (5,), (4, 7)]:
        t = sample_tensor(dtype, shape)
        got = _roundtrip(t, inline_bytes=inline)
        assert got.dtype == dtype and got.shape == t.shape
        assert bitwise_equal(got, t), (dtype, shape)


def test_non_contiguous_views_round_trip() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    views = {
        "transpose": base.transpose(0, 2),
        "permute": base.permute(1, 2, 0),
        "slice_step": base[:, ::2, 1:4],
        "expand": torch.ones(3, 1).expand(3, 4),
        "diagonal": base[0].diagonal(),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "neg_view": torch.randn(3, dtype=torch.complex128).conj().imag,
        "storage_offset": base.reshape(-1)[7:19],
    }
    got = _roundtrip(views)
    for name, v in views.items():
        assert torch.equal(got[name], v.resolve_conj().resolve_neg()), name


def test_dense_views_keep_their_strides_and_gappy_ones_arrive_contiguous() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    got = _roundtrip([t.T, cl, t[:, ::2]])
    assert got[0].stride() == t.T.stride()
    assert got[1].stride() == cl.stride()
    assert got[2].is_contiguous()


def test_dense_tensors_are_sent_from_their_own_memory() -> None:
    t = torch.randn(64, 32)
    wires, metas = wire_tensors([t, t.T])
    assert wires[0].data_ptr() == t.data_ptr() and wires[1].data_ptr() == t.data_ptr()
    assert np.shares_memory(numpy_bytes(wires[0]), t.numpy())
    assert metas[1].stride == (1, 32)
    gappy = t[:, ::2]
    assert not is_dense(gappy) and wire_tensors([gappy])[0][0].is_contiguous()


_Point = collections.namedtuple("_Point", ["x", "y"])


def test_nested_structures_round_trip() -> None:
    w = torch.nn.Parameter(torch.randn(3, 2))
    g = torch.randn(4, requires_grad=True)
    obj = {
        "list": [torch.ones(2), (torch.zeros(1, dtype=torch.int64), None)],
        "pair": Pair(torch.eye(2), {"deep": [torch.full((2,), 3.0)]}),
        "point": _Point(torch.tensor(1.5), 7),
        "param": w,
        "grad_input": g * 2,  # a non-leaf: travels as data, arrives as a leaf that requires grad
        "scalars": (1, 2.5, "s", b"b", None, True, 3 + 4j),
        "set": frozenset({1, 2}),
    }
    got = _roundtrip(obj)
    assert torch.equal(got["list"][0], torch.ones(2))
    assert got["list"][1][1] is None and got["list"][1][0].dtype == torch.int64
    assert isinstance(got["pair"], Pair) and torch.equal(got["pair"].right["deep"][0], torch.full((2,), 3.0))
    assert isinstance(got["point"], _Point) and got["point"].y == 7
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert torch.equal(got["param"].detach(), w.detach())
    assert got["grad_input"].requires_grad and got["grad_input"].is_leaf
    assert got["scalars"] == obj["scalars"] and got["set"] == obj["set"]


def test_huggingface_model_output_round_trips() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    out = modeling_outputs.BaseModelOutputWithPast(
        last_hidden_state=torch.randn(2, 3, 4), hidden_states=(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    )
    got = _roundtrip(out)
    assert type(got) is type(out)
    assert torch.equal(got.last_hidden_state, out.last_hidden_state)
    assert torch.equal(got["hidden_states"][1], out.hidden_states[1])
    assert got.attentions is None


def test_the_same_tensor_twice_travels_once_and_arrives_as_one_object() -> None:
    t = torch.randn(100)
    _, tensors = encode_object([t, {"again": t}, t.view(10, 10)])
    assert len(tensors) == 2  # t once, and the view (a distinct tensor object)
    got = _roundtrip([t, {"again": t}])
    assert got[0] is got[1]["again"]


def test_meta_tensors_move_without_payload() -> None:
    t = torch.empty(1000, 1000, device="meta")
    _, metas = wire_tensors([t])
    assert metas[0].nbytes == 0
    got = _roundtrip(t)
    assert got.device.type == "meta" and got.shape == t.shape


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object refuses to be pickled")


def test_unpicklable_object_raises_on_the_sender_at_once() -> None:
    hub = LoopbackHub(2)
    a, b = hub.transport(0), hub.transport(1)
    with pytest.raises(MessageEncodeError, match=r"_Unpicklable|refuses"):
        a.send({"ok": torch.ones(1), "bad": _Unpicklable()}, 1)
    with pytest.raises(MessageEncodeError, match=r"lambda|local"):
        a.send(lambda: 1, 1)
    assert b.stats["received"] == 0
    a.close()
    b.close()


def test_unpicklable_message_raises_on_the_receiver_naming_source_and_tag() -> None:
    hub = LoopbackHub(2, config=TransportConfig(timeout=5.0))
    a, b = hub.transport(0), hub.transport(1)
    a.send([torch.ones(2), BoomOnLoad()], 1, tag=("req", 3))
    with pytest.raises(MessageDecodeError, match=r"rank 0 with tag \('req', 3\).*cannot rebuild"):
        b.recv()
    a.send("next", 1, tag=1)  # the transport goes on
    assert b.recv().obj == "next"
    a.close()
    b.close()


def test_corrupt_and_foreign_headers_are_refused_by_name() -> None:
    with pytest.raises(MessageDecodeError, match="rank 3"):
        decode_header(b"not a pickle", source=3)
    raw = pickle.dumps((99, "t", 0, 0, b"", None, -1, 0, (), (), b""))
    with pytest.raises(MessageDecodeError, match="protocol version 99"):
        decode_header(raw, source=1)
    bad_dtype = (((2,), (1,), "float1024", "cpu", 0),)
    raw = pickle.dumps((PROTOCOL_VERSION, "t", 0, 0, b"", bad_dtype, -1, 0, (), (), b""))
    with pytest.raises(MessageDecodeError, match="float1024"):
        decode_header(raw, source=1)


def test_header_round_trip() -> None:
    metas = (TensorMeta((2, 3), (3, 1), torch.bfloat16, "cpu", True, False),)
    h = Header(("t", 1), 5, 7, b"body", metas, 2, 0, (b"E", True), (0,), b"\x00" * 12)
    assert decode_header(encode_header(h), source=0) == h


def test_static_metadata_cache_sender_and_receiver_agree() -> None:
    m1 = (TensorMeta((2,), (1,), torch.float32, "cpu", False, False),)
    m2 = (TensorMeta((3,), (1,), torch.float32, "cpu", False, False),)
    out, inn = MetaCacheSender(slots=2), MetaCacheReceiver()

    def trip(dest_tag: str, metas: tuple[TensorMeta, ...]) -> bool:
        slot, hit = out.lookup(1, dest_tag, metas)
        header = Header(dest_tag, 0, 0, b"", None if hit else metas, slot)
        assert inn.resolve(0, header) == metas
        return hit

    assert [trip("a", m1), trip("a", m1), trip("a", m2), trip("a", m2)] == [False, True, False, True]
    assert [trip("b", m1), trip("c", m1), trip("a", m2)] == [False, False, False]  # "a" was evicted
    assert trip("c", m1) and trip("b", m1) is False
    with pytest.raises(MessageDecodeError, match="slot 9"):
        inn.resolve(5, Header("z", 0, 0, b"", None, 9))


def test_static_mode_skips_metadata_and_follows_shape_changes() -> None:
    hub = LoopbackHub(2, config=TransportConfig(static_shapes=True, timeout=5.0))
    a, b = hub.transport(0), hub.transport(1)
    shapes = [(4, 3), (4, 3), (4, 3), (5, 3), (5, 3)]
    for i, shape in enumerate(shapes):
        t = torch.randn(shape)
        a.send({"x": t, "i": i}, 1, tag="act")
        got = b.recv(0, "act").obj
        assert torch.equal(got["x"], t) and got["i"] == i
    assert a.stats["static_hits"] == 3
    a.send(torch.ones(4, 3), 1, tag="act", static=False)
    assert a.stats["static_hits"] == 3 and b.recv().obj.shape == (4, 3)
    a.close()
    b.close()


def test_allocate_maps_devices() -> None:
    metas = [
        TensorMeta((2, 2), (1, 2), torch.float16, "cpu", False, False),
        TensorMeta((3,), (1,), torch.float32, "cuda", False, False),
    ]
    cpu, dev = allocate(metas)
    assert cpu.stride() == (1, 2) and cpu.dtype == torch.float16
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.device.type == expected


def test_byte_view_is_a_view() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).T
    v = byte_view(t)
    assert v.numel() == 12 and v.data_ptr() == t.data_ptr()
    assert decode_object(encode_object(3)[0], []) == 3


_SHAPES = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=_SHAPES,
    perm_seed=st.integers(0, 10_000),
    step=st.integers(1, 3),
)
def test_random_layouts_round_trip(
    dtype: torch.dtype, shape: tuple[int, ...], perm_seed: int, step: int
) -> None:
    t = sample_tensor(dtype, shape, seed=perm_seed)
    if t.dim() > 1:
        perm = torch.randperm(t.dim(), generator=torch.Generator().manual_seed(perm_seed)).tolist()
        t = t.permute(perm)
    if t.dim() >= 1 and step > 1:
        t = t[..., ::step]
    got = _roundtrip({"t": t})["t"]
    assert bitwise_equal(got, t)
    if is_dense(t) and t.numel() > 1:
        assert got.stride() == t.stride()


def test_host_pool_recycles_buffers_when_tensors_die() -> None:
    import gc

    from mp_comm.buffers import HostPool

    pool = HostPool(capacity=1 << 20, min_bytes=1024)
    t = pool.tensor((64, 32), (1, 64), torch.bfloat16, 64 * 32 * 2)
    assert t.shape == (64, 32) and t.stride() == (1, 64) and t.is_leaf and t._base is None
    t.fill_(2.5)
    assert (pool.hits, pool.misses, pool.held) == (0, 1, 0)
    del t
    gc.collect()
    assert pool.held == 4096
    again = pool.tensor((4096,), (1,), torch.uint8, 4096)
    assert pool.hits == 1 and pool.held == 0 and again.numel() == 4096
    small = pool.tensor((4,), (1,), torch.float32, 16)  # below min_bytes: a plain tensor
    assert pool.misses == 1 and small.numel() == 4
    # Idle buffers beyond the capacity push the oldest out.
    big = [pool.tensor((300_000,), (1,), torch.uint8, 300_000) for _ in range(5)]
    del big
    gc.collect()
    assert pool.held <= 1 << 20
    pool.clear()
    assert pool.held == 0


def test_received_tensors_reuse_pooled_memory() -> None:
    import gc

    hub = LoopbackHub(2, config=TransportConfig(timeout=5.0))
    a, b = hub.transport(0), hub.transport(1)
    assert b.pool is not None
    for i in range(4):
        x = torch.full((1024, 1024), float(i))  # 4 MiB: POOL_MIN_BYTES, the pool's threshold
        a.send(x, 1, tag="big")
        got = b.recv(0, "big").obj
        assert torch.equal(got, x)
        del got
        gc.collect()
    assert b.pool.misses == 1 and b.pool.hits == 3
    a.close()
    b.close()


def test_lone_tensor_fast_paths_match_the_general_stub_format() -> None:
    t = torch.arange(6.0)
    body, tensors = encode_object(t)
    assert tensors == [t]
    # The fast path's body is an ordinary stub pickle: the general path reads it too (two tensors).
    assert decode_object(body, [t, torch.zeros(1)]) is t
    assert decode_object(body, [t]) is t
    # A body that names a tensor while none travelled is refused, also on the no-tensor path.
    with pytest.raises(pickle.UnpicklingError):
        decode_object(body, [])
    # Messages with one tensor among other values keep the general path.
    body, tensors = encode_object([t, 1])
    assert decode_object(body, tensors) == [t, 1]
