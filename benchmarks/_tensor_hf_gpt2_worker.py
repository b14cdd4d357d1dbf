"""One 2-rank job of ``tensor_hf_gpt2.py``: builds its variants of one Hugging Face GPT-2 training step,
checks them against plain single-process training, then times them on command.

mp's variants need one ``smp.init`` config each (the config is global, as in smp), so the benchmark runs
one job per config and drives them in turn: every rank reads commands from its own named pipe (a
blocking read sleeps, so an idle job takes no CPU from the one being timed) and rank 0 answers on
stdout with lines starting ``@@``. Commands: ``run <variant> <steps>`` and ``quit``.

Jobs (``--job``):

* ``speed``: ``smp.init({"tensor_parallel_degree": 2, "optimize": "speed"})``; holds mp's speed
  variant (TP across DP: each rank its half of the batch), the DTensor peers and the single-process
  variants (the peers and the single process need only the process group smp.init made);
* ``speed-prescaled``: the same with ``"prescaled_batch": True`` (both ranks the whole batch);
* ``memory``: ``"optimize": "memory"`` (TP across DP; smp's config refuses prescaled_batch there);
* ``speed-spin``: the ``speed`` config in processes started with ``MP_COMM_WAIT=spin`` (MPI's own busy
  wait for mp's collectives instead of the default yield-then-sleep wait; read once per process).

The DTensor peer is the same ``GPT2LMHeadModel`` class with the same weights under
``parallelize_module``. HF GPT-2's projections are ``Conv1D`` (weight ``[in, out]``), which
``ColwiseParallel``/``RowwiseParallel`` do not accept, so for the peer only each ``Conv1D`` is replaced by
an ``nn.Linear`` holding the transposed weight (the same ``addmm``, the weight in Linear's layout). The
fused ``c_attn`` rows are reordered ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` so that the column split gives each
rank whole heads with their q, k and v, and its ``split_size`` becomes ``hidden/tp``. Two plans:
``blocks`` (c_attn, mlp.c_fc Colwise; attn.c_proj, mlp.c_proj Rowwise; embeddings and LM head
replicated) and ``vocab`` (the same plus the tied word embedding Rowwise, i.e. split by vocabulary,
and the LM head Colwise with its logits gathered), torch's tutorial plan for a language model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import mp as smp
from benchmarks._launch import on_all_cores
from mp.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
from mp_tensor.nn import param_spec

TP = 2
LR = 1e-3
TOL = 1e-4
"""Largest accepted difference: losses per step (relative to max(|loss|, 1)) and every gradient of the
first step (relative to the tensor's largest |gradient|)."""
TOL_ADAM = 1e-3
"""The same for every weight after the checked AdamW steps, relative to max(max |weight|, 1). Looser: Adam
divides each update by the gradient's running RMS, so a rounding difference in a gradient near zero moves
its weight by up to ``LR`` per step (seen: 8e-5 after 3 steps)."""

JOBS: dict[str, dict[str, Any]] = {
    "speed": {"tensor_parallel_degree": TP, "optimize": "speed"},
    "speed-prescaled": {"tensor_parallel_degree": TP, "optimize": "speed", "prescaled_batch": True},
    "memory": {"tensor_parallel_degree": TP, "optimize": "memory"},
    "speed-spin": {"tensor_parallel_degree": TP, "optimize": "speed"},  # started with MP_COMM_WAIT=spin
}


def gpt2_config(a: argparse.Namespace) -> GPT2Config:
    return GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.seq,
        n_embd=a.hidden,
        n_layer=a.layers,
        n_head=a.heads,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,  # inside the small vocabulary
        eos_token_id=0,
    )


def fresh_model(a: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every variant starts from the same weights
    return GPT2LMHeadModel(gpt2_config(a))


def data(a: argparse.Namespace) -> Tensor:
    """``[checked steps + 1, batch, seq]`` token ids; the last batch is the one timed."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, a.vocab, (a.check_steps + 1, a.batch, a.seq), generator=g)


@dataclass
class Variant:
    key: str
    step: Callable[[Tensor], Tensor]
    """One training step (forward, backward, AdamW) on a global batch; returns the mean loss over the
    samples this rank was fed (the global batch, or its half under TP across DP)."""
    state: Callable[[bool], dict[str, Tensor]]
    """The full weights (True: their gradients) in Hugging Face's names and layout, shards gathered
    (collective for the distributed variants)."""
    single: bool = False
    threads: int = 1


# --- single process ------------------------------------------------------------------------------


def single_variant(key: str, model: GPT2LMHeadModel, threads: int) -> Variant:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(ids: Tensor) -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss: Tensor = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    def state(grads: bool) -> dict[str, Tensor]:
        return {n: _value(p, grads) for n, p in model.named_parameters()}

    return Variant(key, step, state, True, threads)


def _value(p: Tensor, grad: bool) -> Tensor:
    t = p.grad if grad else p
    assert t is not None
    return t.detach()


# --- DTensor peer ---------------------------------------------------------------------------------


def _linear_of(conv: Conv1D) -> nn.Linear:
    lin = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    return lin


def _head_major(rows: Tensor, hidden: int) -> Tensor:
    """c_attn's ``[q | k | v]`` output rows reordered ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` (and back with
    :func:`_qkv_major`): the column split then hands rank r its heads' q, k and v."""
    return rows.reshape(3, TP, hidden // TP, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def _qkv_major(rows: Tensor, hidden: int) -> Tensor:
    return rows.reshape(TP, 3, hidden // TP, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def peer_model(a: argparse.Namespace, mesh: DeviceMesh, plan: str) -> GPT2LMHeadModel:
    model = fresh_model(a)
    h = a.hidden
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        qkv = _linear_of(attn.c_attn)
        with torch.no_grad():
            qkv.weight.copy_(_head_major(qkv.weight, h))
            qkv.bias.copy_(_head_major(qkv.bias, h))
        attn.c_attn, attn.c_proj = qkv, _linear_of(attn.c_proj)
        attn.split_size = h // TP  # the local q, k, v widths (the heads count is inferred: -1)
        mlp.c_fc, mlp.c_proj = _linear_of(mlp.c_fc), _linear_of(mlp.c_proj)
        styles: dict[str, ParallelStyle] = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        parallelize_module(block, mesh, styles)
    if plan == "vocab":
        parallelize_module(model.transformer.wte, mesh, RowwiseParallel(input_layouts=Replicate()))
        parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))
        model.lm_head.weight = model.transformer.wte.weight  # tied again: one DTensor, split by vocabulary
    return model


def peer_state(model: GPT2LMHeadModel, hidden: int, grads: bool) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = _value(p, grads)
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if ".attn.c_attn." in name:
            t = _qkv_major(t, hidden)
        if name.endswith("weight") and (".c_attn." in name or ".c_proj." in name or ".c_fc." in name):
            t = t.t()  # Linear's [out, in] back to Conv1D's [in, out]
        out[name] = t
    return out


def peer_variant(key: str, a: argparse.Namespace, mesh: DeviceMesh, plan: str) -> Variant:
    model = peer_model(a, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(ids: Tensor) -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss: Tensor = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return Variant(key, step, lambda grads: peer_state(model, a.hidden, grads))


# --- mp, as a user wraps it ------------------------------------------------------------------------


@smp.step
def train_step(model: Any, ids: Tensor) -> Tensor:
    loss: Tensor = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def mp_variant(key: str, a: argparse.Namespace, prescaled: bool) -> Variant:
    with smp.tensor_parallelism():  # docs/tensor.md: GPT2LMHeadModel becomes DistributedTransformerLMHead
        model = fresh_model(a)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    rank = dist.get_rank()

    def step(ids: Tensor) -> Tensor:
        local = ids if prescaled else ids.chunk(TP)[rank]  # TP across DP: each rank its own samples
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, local).reduce_mean().detach()
        opt.step()
        return loss

    def state(grads: bool) -> dict[str, Tensor]:
        if not grads:
            return {k: v.detach() for k, v in model.state_dict().items()}  # Hugging Face's keys, gathered
        out = {}
        for name, p in model.get_module().named_parameters():
            g, spec = _value(p, True), param_spec(p)
            if spec is not None and spec.split_dim is not None:
                parts = [torch.empty_like(g) for _ in range(TP)]
                dist.all_gather(parts, g.contiguous(), group=smp.get_tp_process_group())
                g = torch.cat(parts, spec.split_dim)
            out[name] = g
        return dict(translate_state_dict_to_hf_gpt2(out))

    return Variant(key, step, state)


# --- check, timing, the command loop ---------------------------------------------------------------


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1.0))


def _rel_grad(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def _compare(
    got: dict[str, Tensor], want: dict[str, Tensor], rel: Callable[[Tensor, Tensor], float]
) -> dict[str, Any]:
    diffs = {k: rel(got[k], w) for k, w in want.items() if k in got}
    worst = max(diffs, key=lambda k: diffs[k])
    return {
        "compared": len(diffs),
        "missing": sorted(set(want) - set(got)),
        "max": diffs[worst],
        "worst": worst,
    }


def check(v: Variant, batches: Tensor, want: dict[str, Any]) -> dict[str, Any]:
    """Train ``v`` on the checked batches: its global losses, first-step gradients and final weights
    against the reference's."""
    losses, grads = [], {}
    for i, ids in enumerate(batches):
        loss = v.step(ids).reshape(1).double()
        if not v.single:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()  # equal halves (or equal copies): the global mean
        losses.append(float(loss))
        if i == 0:
            grads = _compare(v.state(True), want["grads"], _rel_grad)
    weights = _compare(v.state(False), want["weights"], _rel)
    loss_diff = max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(losses, want["losses"], strict=True))
    ok = loss_diff <= TOL and grads["max"] <= TOL and weights["max"] <= TOL_ADAM
    return {
        "losses": losses,
        "loss_max_rel_diff": loss_diff,
        "grads": grads,
        "weights": weights,
        "ok": ok and not grads["missing"] and not weights["missing"],
    }


def timed(v: Variant, ids: Tensor, steps: int) -> float:
    """Seconds per step of ``v``; for a distributed variant the slowest rank's (collective)."""
    if v.single:
        torch.set_num_threads(v.threads)
        with on_all_cores() if v.threads > 1 else contextlib.nullcontext():
            start = time.perf_counter()
            for _ in range(steps):
                v.step(ids)
            elapsed = (time.perf_counter() - start) / steps
        torch.set_num_threads(1)
        return elapsed
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        v.step(ids)
    t = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"@@ {kind} {json.dumps(payload)}", flush=True)


def build(job: str, a: argparse.Namespace) -> list[Variant]:
    variants: list[Variant] = []
    if job == "speed":
        if dist.get_rank() == 0:
            variants += [single_variant("single-1t", fresh_model(a), 1)]
            variants += [single_variant("single-2t", fresh_model(a), 2)]
        mesh = init_device_mesh("cpu", (TP,))
        variants += [peer_variant("dtensor-blocks", a, mesh, "blocks")]
        variants += [peer_variant("dtensor-vocab", a, mesh, "vocab")]
        variants += [mp_variant("mp-speed", a, prescaled=False)]
    elif job == "speed-prescaled":
        variants += [mp_variant("mp-speed-prescaled", a, prescaled=True)]
    elif job == "speed-spin":
        if os.environ.get("MP_COMM_WAIT") != "spin":
            raise SystemExit("the speed-spin job runs with MP_COMM_WAIT=spin")
        variants += [mp_variant("mp-speed-spin", a, prescaled=False)]
    else:
        variants += [mp_variant("mp-memory", a, prescaled=False)]
    return variants


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=sorted(JOBS), required=True)
    p.add_argument("--ctl", required=True, help="folder of the command pipes (<job>.<rank>)")
    p.add_argument(
        "--model", required=True, help="JSON of layers, hidden, heads, vocab, seq, batch, check_steps"
    )
    args = p.parse_args()
    a = argparse.Namespace(**json.loads(args.model))
    torch.set_num_threads(1)
    smp.init(JOBS[args.job])
    rank = dist.get_rank()
    batches = data(a)
    # the reference: plain Hugging Face training in this process, on the global batches
    ref = single_variant("reference", fresh_model(a), 1)
    want: dict[str, Any] = {"losses": []}
    for i, ids in enumerate(batches[:-1]):
        want["losses"].append(float(ref.step(ids)))
        if i == 0:
            want["grads"] = ref.state(True)
    want["weights"] = ref.state(False)
    variants = build(args.job, a)
    checks = {v.key: check(v, batches[:-1], want) for v in variants}
    if rank == 0:
        emit("ready", {"job": args.job, "variants": [v.key for v in variants], "checks": checks})
    by_key = {v.key: v for v in variants}
    ids = batches[-1]
    with open(Path(args.ctl) / f"{args.job}.{rank}") as ctl:
        for line in ctl:
            words = line.split()
            if not words or words[0] == "quit":
                break
            key, steps = words[1], int(words[2])
            v = by_key.get(key)
            if v is None:  # a single-process variant: rank 0 only
                continue
            t = timed(v, ids, steps)
            if rank == 0:
                emit("time", {"variant": key, "s": t})
    smp.shutdown()


if __name__ == "__main__":
    main()
