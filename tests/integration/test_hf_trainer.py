"""transformers' own Trainer on its smp path (SM_HP_MP_PARAMETERS set, smp imported as
``smdistributed.modelparallel.torch``, i.e. mp's alias) at pp=2 on a tiny GPT-2 trains, evaluates and
saves like the same Trainer script without smp.

The installed transformers (5.x) needs mp.hf_trainer's helpers on this path: SMPTrainingArguments (no
CUDA: the CPU instead of torch.cuda.set_device) and SMPTrainer (creates the optimizer, which 5.x never
does there; clips by the whole model's norm; reuses the wrapped model for evaluation). Without smp they
change nothing, and the reference run uses transformers' own classes anyway.

Both runs read the batches in order (train_sampling_strategy="sequential") with dropout off (each
pipeline stage draws its own random numbers), and the reference lets the model average its loss
(model_accepts_loss_kwargs=False) as the smp path does: transformers otherwise divides the summed loss
by the number of labels before shifting (64 instead of 60 here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._harness import run_script

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

SCRIPT = """
import json, os, sys
import torch
import transformers as hf

out, mode = os.environ["HF_TEST_OUT"], os.environ["HF_TEST_MODE"]
checkpoints, resume = os.environ.get("HF_TEST_SAVE") == "1", os.environ.get("HF_TEST_RESUME")
if mode == "smp":
    from mp.hf_trainer import SMPTrainer as Trainer, SMPTrainingArguments as TrainingArguments
else:
    from transformers import Trainer, TrainingArguments


kind = os.environ.get("HF_TEST_MODEL", "gpt2")


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=gen)
        self.targets = torch.randint(0, 64, (n, 8), generator=gen)
        self.classes = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if kind == "bert":
            return {"input_ids": self.ids[i], "labels": self.classes[i]}
        if kind == "t5":
            return {"input_ids": self.ids[i], "labels": self.targets[i]}
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model():
    if kind == "bert":
        return hf.BertForSequenceClassification(hf.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    if kind == "t5":
        return hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, use_cache=False))
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


torch.manual_seed(0)
if os.environ.get("HF_TEST_TP") == "1":  # smp's way: TP replaces the blocks created inside this context
    import smdistributed.modelparallel.torch as smp
    with smp.tensor_parallelism():
        model = make_model()
else:
    model = make_model()
args = TrainingArguments(
    output_dir=out, per_device_train_batch_size=int(os.environ.get("HF_TEST_BATCH", "4")),
    per_device_eval_batch_size=4, max_steps=6,
    learning_rate=1e-3, logging_steps=1, report_to=[], seed=0,
    save_strategy="steps" if checkpoints else "no", save_steps=2, save_total_limit=2,
    dataloader_drop_last=True, train_sampling_strategy="sequential", max_grad_norm=0.5,
)
trainer = Trainer(model=model, args=args, train_dataset=Data(32, 0), eval_dataset=Data(8, 1))
trainer.model_accepts_loss_kwargs = False  # the model's own mean loss, as on the smp path
trainer.train(resume_from_checkpoint=resume)
evaluation = trainer.evaluate()
if not checkpoints:
    trainer.save_model(out + "/final")
if trainer.is_world_process_zero():
    logs = [h for h in trainer.state.log_history if "loss" in h]
    record = {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
              "eval_loss": evaluation["eval_loss"], "steps": [h["step"] for h in logs],
              "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))}
    if mode == "smp":
        import smdistributed.modelparallel.torch as smp
        import mp
        record["alias"] = smp is mp and trainer.args.parallel_mode.value
        record["distributed"] = sum(1 for _ in trainer.model_wrapped.distributed_modules())
    with open(out + "/record.json", "w") as f:
        json.dump(record, f)
"""

SMP_ENV = {
    "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2, "ddp": True}),
    "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}),
}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "final" / "model.safetensors"))


@pytest.mark.parametrize("model", ["gpt2", "bert", "t5"])
def test_the_trainer_at_pp2_trains_like_the_plain_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, model: str
) -> None:
    """GPT-2 (causal LM), BERT (sequence classification), T5 (encoder-decoder)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    want, plain_out = _plain(tmp_path_factory, HF_TEST_MODEL=model)
    smp_out = tmp_path / "smp"
    got = _run(script, smp_out, "smp", HF_TEST_MODEL=model)
    assert got["alias"] == "sagemaker_model_parallel", got  # the Trainer took its smp path, through mp
    assert len(got["loss"]) == len(want["loss"]) == 6
    # the gradient norm (above max_grad_norm=0.5: every step clips) spans both pipeline stages
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    saved, reference = _weights(smp_out), _weights(plain_out)
    # mp's gathered state_dict holds a tied weight (GPT-2's lm_head, T5's embeddings) as a tensor of its
    # own, so save_pretrained cannot see the tie and writes it too (the plain run drops it): a copy
    assert set(reference) <= set(saved), sorted(set(reference) - set(saved))
    for extra in set(saved) - set(reference):
        twins = [k for k in reference if torch.equal(saved[k], saved[extra])]
        assert twins, f"{extra} is saved by the smp run only and ties to no saved weight"
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _run(script: Path, out: Path, mode: str, n: int = 2, **extra: str) -> dict[str, Any]:
    env = {"HF_TEST_OUT": str(out), "HF_TEST_MODE": mode, **extra}
    if mode == "plain":
        environ = {k: v for k, v in os.environ.items() if k not in SMP_ENV}
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env={**environ, **env}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        output, code, _ = run_script(script, n, env={**SMP_ENV, **env}, timeout=300)
        assert code == 0, output[-5000:]
        # the Trainer steps the optimizer its scheduler was made on: torch gives no order warning
        assert "Detected call of `lr_scheduler.step()`" not in output, output[-5000:]
    record: dict[str, Any] = json.loads((out / "record.json").read_text())
    return record


# The plain Trainer's runs, by their settings: several tests compare with the same reference run (GPT-2
# on 8 samples a step is the reference of three), so each runs once per session.
_PLAIN_RUNS: dict[tuple[tuple[str, str], ...], tuple[dict[str, Any], Path]] = {}


def _plain(tmp_path_factory: pytest.TempPathFactory, **extra: str) -> tuple[dict[str, Any], Path]:
    """The plain Trainer's record and output folder for these settings (SCRIPT's defaults filled in)."""
    settings = {"HF_TEST_MODEL": "gpt2", "HF_TEST_BATCH": "4", **extra}
    key = tuple(sorted(settings.items()))
    if key not in _PLAIN_RUNS:
        folder = tmp_path_factory.mktemp("plain")
        script = folder / "train.py"
        script.write_text(SCRIPT)
        _PLAIN_RUNS[key] = (_run(script, folder / "out", "plain", **settings), folder / "out")
    return _PLAIN_RUNS[key]


def test_checkpoint_rotation_and_resume_through_the_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """save_steps=2 with save_total_limit=2 keeps checkpoint-4 and -6 (smp.save of the optimizer's
    partial state included); resuming from checkpoint-4 trains steps 5 and 6 as the run that went on."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain, _ = _plain(tmp_path_factory, HF_TEST_SAVE="1")
    whole = _run(script, tmp_path / "smp", "smp", HF_TEST_SAVE="1")
    assert whole["checkpoints"] == plain["checkpoints"] == ["checkpoint-4", "checkpoint-6"], whole
    assert whole["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    resumed_out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "smp" / "checkpoint-4", resumed_out / "checkpoint-4")
    resumed = _run(
        script, resumed_out, "smp", HF_TEST_SAVE="1", HF_TEST_RESUME=str(resumed_out / "checkpoint-4")
    )
    assert resumed["steps"] == [1, 2, 3, 4, 5, 6], resumed  # 1-4 from the checkpoint's trainer state
    assert resumed["loss"][4:] == pytest.approx(whole["loss"][4:], rel=1e-6)
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)


def test_data_parallel_replicas_share_the_data(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """pp=2 x dp=2: each replica reads its half of the batches (SMPTrainer's DistributedSampler), so
    4 samples per replica train like the plain Trainer on 8."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain, _ = _plain(tmp_path_factory, HF_TEST_BATCH="8")
    got = _run(script, tmp_path / "smp", "smp", n=4, HF_TEST_BATCH="4")
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(plain[key], rel=1e-5), key
    assert got["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("model", "pp", "prescaled"),
    [("gpt2", 1, False), ("gpt2", 1, True), ("gpt2", 2, False), ("bert", 2, False), ("t5", 2, False)],
)
def test_the_trainer_with_tensor_parallelism(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, model: str, pp: int, prescaled: bool
) -> None:
    """tp=2 (the blocks replaced by smp.tensor_parallelism()), and tp=2 x pp=2 on 4 ranks for GPT-2, BERT
    and T5: without prescaled_batch the two TP ranks are data-parallel replicas reading 4 samples each
    (like the plain Trainer on 8); with it they read the same 4. save_model writes the whole model in
    HF's layout."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg: dict[str, Any] = {"partitions": pp, "tensor_parallel_degree": 2, "microbatches": pp, "ddp": True}
    if prescaled:
        cfg.update(prescaled_batch=True, optimize="speed")
    batch = "4" if prescaled else "8"
    plain, plain_out = _plain(tmp_path_factory, HF_TEST_BATCH=batch, HF_TEST_MODEL=model)
    got = _run(
        script,
        tmp_path / "smp",
        "smp",
        2 * pp,
        HF_TEST_TP="1",
        HF_TEST_MODEL=model,
        SM_HP_MP_PARAMETERS=json.dumps(cfg),
    )
    assert got["distributed"] > 0, got  # tensor parallelism took place
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(plain[key], rel=1e-5), key
    assert got["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    saved, reference = _weights(tmp_path / "smp"), _weights(plain_out)
    assert set(reference) <= set(saved), sorted(set(reference) - set(saved))
    # TP sums partial products in another order; Adam turns the rounding of near-zero gradient
    # elements into updates of up to ~1e-5 after 6 steps (lr 1e-3: a wrong update would be ~1e-3)
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=5e-5, msg=name)
