"""The flow of smp's public GPT-2 example, ``train_gpt_simple.py`` (amazon-sagemaker-examples, smp >= 1.10),
with its default flags at a tiny size, on real ranks.

What the script does with its defaults, reproduced step by step in :func:`_script`: the smp config it
builds, ``smp.model_creation(tensor_parallelism=True, ...)`` around ``AutoModelForCausalLM.from_config``
(``use_distributed_transformer=1``, with ``query_key_layer_scaling``, ``fused_softmax`` and
``fused_bias_gelu`` on), ``m.transformer.seq_layers`` read after ``smp.DistributedModel``, its weight-decay
parameter groups, Adam, ``smp.set_activation_checkpointing(seq_layers, strategy="each")``, the
``DistributedOptimizer``, ``prescaled_batch`` data, ``model(...)["loss"]`` in the step, partial
``save_checkpoint`` every ``checkpoint_freq`` steps, ``resume_from_checkpoint`` in a new job
(``load_partial``), and the final full save (``save_final_full_model``). Its data pipeline and
``AnnealingLR`` (files of the example) are replaced by random token batches and a linear LambdaLR.
Two departures, both mp policies outside this feature: the script's dynamic loss-scaling arguments are
passed under fp16 only (mp refuses them in fp32), and the resuming job sets ``MP_CHECKPOINT_TRUST=1``
(its ``user_content`` holds a ``GPT2Config``, which mp does not unpickle from an untrusted file).

Each run is checked against plain Hugging Face GPT-2 in one process on the same initial weights and the
global batch: losses every step, every gradient of the first step (all stages and TP shards), and the
full state dict (Hugging Face names) after the optimizer steps, within 1e-5; the resumed job continues
exactly, and the full save loads into ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import mp as smp

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, STEPS = 16, 96, 4

DEFAULTS = {  # train_gpt_simple.py's defaults, model sized down, dropout off (equality), lr given
    "train_batch_size": 2,
    "max_steps": STEPS,
    "seed": 12345,
    "same_seed": 0,
    "fp16": 0,
    "bf16": 0,
    "weight_decay": 0.01,
    "beta1": 0.9,
    "beta2": 0.95,
    "activation_checkpointing": 1,
    "activation_strategy": "each",
    "prescaled_batch": 1,
    "max_context_width": SEQ,
    "vocab_size": VOCAB,
    "hidden_width": 32,
    "num_layers": 4,
    "num_heads": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "summary_first_pdrop": 0.0,
    "use_adamw": 0,
    "use_distributed_transformer": 1,
    "checkpoint_sublayers": 0,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "microbatches": 1,
    "optimize": "speed",
    "shard_optimizer_state": 0,
    "offload_activations": 0,
    "fast_mode": 0,
    "static_mode": 0,
    "delayed_param": 0,
    "placement_strategy": "cluster",
    "activation_loading_horizon": 4,
    "skip_tracing": 0,
    "attention_in_fp32": 0,
    "query_key_layer_scaling": 1,
    "fused_softmax": 1,
    "fused_dropout": 0,
    "fused_bias_gelu": 1,
    "gradient_accumulation": 1,
    "checkpoint_freq": 2,
    "manual_partition": 0,
    "lr": 1e-3,
    "sharded_data_parallel_degree": 1,
    "save_final_full_model": 1,
    "load_partial": 0,
}


def _args(**overrides: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**DEFAULTS, **overrides})


def _model_config(args: SimpleNamespace) -> Any:
    """The script's GPT2Config."""
    return transformers.GPT2Config(
        vocab_size=args.vocab_size,
        n_positions=args.max_context_width,
        n_embd=args.hidden_width,
        n_layer=args.num_layers,
        n_head=args.num_heads,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=args.resid_pdrop,
        embd_pdrop=args.embd_pdrop,
        attn_pdrop=args.attn_pdrop,
        layer_norm_epsilon=1e-05,
        initializer_range=0.02,
        summary_first_dropout=args.summary_first_pdrop,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        return_dict=True,
    )


def _data(batch: int, steps: int = STEPS + 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batches of token ids and attention masks (some sequences padded at the end)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (steps, batch, SEQ), generator=g)
    mask = torch.ones(steps, batch, SEQ, dtype=torch.long)
    mask[:, ::2, SEQ - 3 :] = 0
    return ids, mask


def _param_groups(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The script's get_param_groups_by_weight_decay (LayerNorm = smp.nn.FusedLayerNorm)."""
    decay: dict[str, Any] = {"params": []}
    no_decay: dict[str, Any] = {"params": [], "weight_decay": 0.0}
    seen: set[int] = set()
    for sub in module.modules():
        for n, p in list(sub._parameters.items()):
            if p is None or id(p) in seen:
                continue
            if isinstance(sub, smp.nn.FusedLayerNorm) or n == "bias":
                no_decay["params"].append(p)
            else:
                decay["params"].append(p)
            seen.add(id(p))
    return decay, no_decay


def _schedule(optimizer: Any, args: SimpleNamespace) -> Any:
    """A stand-in for the script's AnnealingLR: linear warmup over 1 step, then linear decay."""
    total = STEPS + 4  # the same in the first job and the resumed one
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2) * (1 - s / total))


@smp.step
def train_step(model: Any, optimizer: Any, input_ids: Any, attention_mask: Any, args: Any) -> Any:
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def _gradients(model: Any) -> dict[str, torch.Tensor]:
    """The first step's gradients in Hugging Face's names: TP shards gathered, pipeline stages joined."""
    from mp_tensor.hf.translate import gpt2_from_smp
    from mp_tensor.nn.base import param_spec

    group = smp.get_tp_process_group() if smp.tp_size() > 1 else None
    local = {n.removeprefix("module."): p for n, p in model.local_named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.get_module().named_parameters():
        if name not in local:  # another stage's
            continue
        assert p.grad is not None, name
        g, spec = p.grad.detach().clone(), param_spec(p)
        if group is not None and spec is not None and spec.split_dim is not None:
            parts = [torch.empty_like(g) for _ in range(smp.tp_size())]
            torch.distributed.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts, spec.split_dim % g.dim())
        grads[name] = g
    if smp.pp_size() > 1:
        parts: list[Any] = [None] * smp.pp_size()
        torch.distributed.all_gather_object(parts, grads, group=smp.get_pp_process_group())
        grads = {k: v for part in parts for k, v in part.items()}
    return gpt2_from_smp(grads)


def _script(world: Any, args: SimpleNamespace, checkpoint_dir: str, model_dir: str) -> dict[str, Any]:
    """train_gpt_simple.py's main() and train(), as the script runs them (comments name its steps)."""
    smp_config = {
        "ddp": True,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "fp16": args.fp16 > 0,
        "bf16": args.bf16 > 0,
        "offload_activations": args.offload_activations > 0,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "optimize": args.optimize,
        "placement_strategy": args.placement_strategy,
        "activation_loading_horizon": args.activation_loading_horizon,
        "skip_tracing": args.skip_tracing > 0,
        "auto_partition": not args.manual_partition,
        "default_partition": 0,
        "static_mode": args.static_mode > 0,
        "fast_mode": args.fast_mode > 0,
        "sharded_data_parallel_degree": args.sharded_data_parallel_degree,
    }
    smp.init(smp_config)
    model_config = _model_config(args)
    # "skipping proper initialization ... DistributedModel will override those weights anyway"
    pretrained = transformers.modeling_utils.PreTrainedModel
    saved_init = pretrained.init_weights
    if args.use_distributed_transformer > 0:
        pretrained.init_weights = lambda x: None
    try:
        transformers.set_seed(args.seed)
        dtype = torch.get_default_dtype()
        with smp.model_creation(
            tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
            dtype=dtype,
            attention_in_fp32=args.attention_in_fp32 > 0,
            query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
            fused_softmax=args.fused_softmax > 0,
            fused_dropout=args.fused_dropout > 0,
            fused_bias_gelu=args.fused_bias_gelu > 0,
        ):
            model = transformers.AutoModelForCausalLM.from_config(model_config)
    finally:
        pretrained.init_weights = saved_init
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not args.same_seed:
        transformers.set_seed(args.seed + smp.tp_rank())
    model = smp.DistributedModel(
        model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation
    )
    m = model.get_module()
    transformer_layers = m.transformer.seq_layers if args.use_distributed_transformer > 0 else m.transformer.h
    if args.manual_partition:  # evenly distribute layers across all partitions
        div, rem = divmod(args.num_layers, smp.pp_size())
        assignments = []
        for pp_rank in range(smp.pp_size()):
            assignments += [pp_rank] * (div + 1 if pp_rank >= smp.pp_size() - rem else div)
        for i, c in enumerate(transformer_layers.children()):
            smp.set_partition(c, assignments[i])
    param_groups = _param_groups(m)
    optimizer: Any = torch.optim.Adam(
        param_groups, betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay
    )
    if args.activation_checkpointing:
        if args.checkpoint_sublayers:
            for c in transformer_layers.children():
                smp.set_activation_checkpointing(c.attention)
                smp.set_activation_checkpointing(c.output)
        else:
            smp.set_activation_checkpointing(transformer_layers, strategy=args.activation_strategy)
    # As the script does: dynamic loss scaling whatever the precision (in fp32 it takes no effect, as in
    # smp; mp warns once)
    scaling = {
        "static_loss_scale": None,
        "dynamic_loss_scale": True,
        "dynamic_loss_args": {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    }
    optimizer = smp.DistributedOptimizer(optimizer, **scaling)
    lr_scheduler = _schedule(optimizer, args)
    total_steps = 0
    if args.load_partial:
        # user_content holds the GPT2Config (code to unpickle): the job's environment trusts its own files
        os.environ["MP_CHECKPOINT_TRUST"] = "1"
        try:
            user_content = smp.resume_from_checkpoint(checkpoint_dir, tag=None, partial=True)
        finally:
            del os.environ["MP_CHECKPOINT_TRUST"]
        total_steps = user_content["total_steps"]
        lr_scheduler.load_state_dict(user_content["lr_scheduler"])

    # train(): prescaled_batch -> the TP group shares samples; rdp ranks split the global batch
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()
    batch = args.train_batch_size
    ids, masks = _data(batch * dp_size)
    losses, gradients = [], None
    model.train()
    while total_steps < args.max_steps:
        input_ids = ids[total_steps, dp_rank * batch : (dp_rank + 1) * batch]
        attention_mask = masks[total_steps, dp_rank * batch : (dp_rank + 1) * batch]
        optimizer.zero_grad(set_to_none=True)
        loss_mb = train_step(model, optimizer, input_ids, attention_mask, args)
        loss = loss_mb.reduce_mean()
        if gradients is None:
            gradients = _gradients(model)
        optimizer.step()
        lr_scheduler.step()
        total_steps += 1
        # the global loss: each data-parallel replica's mean, averaged
        losses.append(float(sum(smp.allgather(loss.item(), smp.RDP_GROUP)) / smp.rdp_size()))
        if not (total_steps % args.checkpoint_freq):
            user_content = {
                "cli_args": vars(args),
                "total_steps": total_steps,
                "model_config": model_config,
                "start_batch_index": total_steps,
                "lr_scheduler": lr_scheduler.state_dict(),
            }
            smp.save_checkpoint(
                checkpoint_dir,
                tag=f"total_steps{total_steps}",
                partial=True,
                model=model,
                optimizer=optimizer,
                user_content=user_content,
                num_kept_partial_checkpoints=5,
            )
    if args.save_final_full_model:
        user_content = {"cli_args": vars(args), "total_steps": total_steps, "model_config": model_config}
        smp.save_checkpoint(
            model_dir, tag="fullmodel.pt", partial=False, model=model, user_content=user_content
        )
    smp.barrier()
    out = {
        "losses": losses,
        "initial": initial,
        "gradients": gradients,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "layers": type(transformer_layers).__name__,
        "pp_rank": smp.pp_rank(),
        "owned": sorted(n for n, _ in model.local_named_parameters()),
        "model": type(m).__name__,
    }
    smp.reset()
    return out


def _reference(args: SimpleNamespace, initial: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """Plain Hugging Face GPT-2, one process, the global batch of every step."""
    model = transformers.GPT2LMHeadModel(_model_config(args))
    # The script skips init_weights, which ties lm_head to wte; the config ties them, and so does mp.
    model.load_state_dict({**initial, "lm_head.weight": initial["transformer.wte.weight"]})
    optimizer = torch.optim.Adam(
        _param_groups(model), betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay
    )
    lr_scheduler = _schedule(optimizer, args)
    ids, masks = _data(args.train_batch_size * args.dp)
    losses, gradients = [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[step], attention_mask=masks[step], labels=ids[step]).loss
        loss.backward()
        if gradients is None:
            gradients = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            gradients["lm_head.weight"] = gradients["transformer.wte.weight"]
        optimizer.step()
        lr_scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "gradients": gradients, "state": model.state_dict()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for key, value in want.items():
        torch.testing.assert_close(
            got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{what}, {key}: {m}"
        )


LAYOUTS = [  # (ranks, tp, pp, other flags): tp=1 is two data-parallel replicas
    pytest.param(2, 1, 1, {}, id="tp1"),
    pytest.param(2, 2, 1, {}, id="tp2"),
    pytest.param(4, 2, 2, {}, id="tp2xpp2"),
    # --manual_partition 1 (seq_layers' children split evenly by smp.set_partition), and
    # --checkpoint_sublayers 1 (each layer's attention and output checkpointed)
    pytest.param(4, 2, 2, {"manual_partition": 1, "checkpoint_sublayers": 1}, id="tp2xpp2-manual"),
]


@pytest.mark.parametrize(("n", "tp", "pp", "flags"), LAYOUTS)
def test_train_gpt_simple_defaults_train_like_hugging_face(  # noqa: PLR0917
    worlds: Any, tmp_path: Any, n: int, tp: int, pp: int, flags: dict[str, Any]
) -> None:
    args = _args(tensor_parallel_degree=tp, pipeline_parallel_degree=pp, **flags)
    ckpt, model_dir = str(tmp_path / "ckpt"), str(tmp_path / "model")
    results = worlds.run(n, _script, args, ckpt, model_dir, timeout=300)
    args.dp = n // (tp * pp)
    ref = _reference(args, results[0]["initial"], STEPS)
    for r, res in enumerate(results):
        assert res["model"] == "GPT2DistributedLMHead" and res["layers"] == "Sequential", res["model"]
        layers = {m[1] for m in (re.search(r"seq_layers\.(\d+)\.", n) for n in res["owned"]) if m}
        if pp > 1 and flags.get("manual_partition"):  # the script's even split: layers 0-1, 2-3
            assert layers == ({"0", "1"} if res["pp_rank"] == 0 else {"2", "3"}), res["owned"]
        elif pp > 1:  # the pipeline partitions seq_layers: each stage holds some of the layers
            assert 0 < len(layers) < DEFAULTS["num_layers"], (res["pp_rank"], res["owned"])
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
            msg=lambda m, r=r: f"rank {r} losses: {m}",
        )  # fmt: skip
        assert all(math.isfinite(x) for x in res["losses"])
        _close(res["gradients"], ref["gradients"], f"rank {r} first-step gradient")
        _close(res["state"], ref["state"], f"rank {r} state_dict after {STEPS} steps")
    # the final full save has Hugging Face's names and loads into GPT2LMHeadModel
    saved = torch.load(os.path.join(model_dir, "fullmodel.pt"), weights_only=False)
    fresh = transformers.GPT2LMHeadModel(_model_config(args))
    fresh.load_state_dict(saved, strict=True)
    _close(fresh.state_dict(), ref["state"], "the full save")

    # a new job resumes from the newest partial checkpoint (load_partial) and trains two more steps
    more = _args(
        tensor_parallel_degree=tp, pipeline_parallel_degree=pp, load_partial=1, max_steps=STEPS + 2,
        save_final_full_model=0, **flags,
    )  # fmt: skip
    resumed = worlds.run(n, _script, more, ckpt, model_dir, timeout=300)
    ref6 = _reference(args, results[0]["initial"], STEPS + 2)
    for r, res in enumerate(resumed):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref6["losses"][STEPS:]), rtol=1e-5, atol=1e-6,
            msg=lambda m, r=r: f"rank {r} resumed losses: {m}",
        )  # fmt: skip
        _close(res["state"], ref6["state"], f"rank {r} state_dict after resuming")
