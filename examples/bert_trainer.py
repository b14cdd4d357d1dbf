"""BERT fine-tuning (sequence classification) through Hugging Face's own Trainer, on its smp path.

    mp-launch -n 2 examples/bert_trainer.py                           # pp=2
    mp-launch -n 4 examples/bert_trainer.py --tp 2                    # tp=2 x pp=2
    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 4, "ddp": true}' \\
        mp-launch -n 4 examples/bert_trainer.py                       # pp=2 x dp=2, config as on SageMaker

The Trainer switches to model parallelism by itself when ``SM_HP_MP_PARAMETERS`` (the smp config, as
SageMaker passed it) names ``partitions`` and ``smdistributed`` can be imported: mp serves that import.
Left unset, this script sets it from ``--pp``, ``--tp`` and ``--microbatches``. The only change to a
plain Trainer script is the import of ``SMPTrainer`` and ``SMPTrainingArguments`` from
``mp.hf_trainer`` (see docs/migrating.md): they fix what transformers gets wrong on this path (the
device without CUDA, the optimizer, clipping over all stages, each replica's share of the data);
without ``SM_HP_MP_PARAMETERS`` they are transformers' own classes. The model is built from a tiny
config (nothing downloaded) and the data is synthetic: each class draws its tokens from its own third
of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _common import log_loss, plot_losses, summary


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="partitions (pipeline stages)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="per data-parallel replica")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--out", default="bert_out", help="the Trainer's output_dir")
    p.add_argument("--plot", help="write the loss curve to this PNG file")
    return p.parse_args()


args = parse()
# What SageMaker set for an smp job. Before importing the Trainer: transformers decides at import time
# whether it imports smdistributed.
cfg = {"partitions": args.pp, "microbatches": args.microbatches, "ddp": True}
if args.tp > 1:
    cfg["tensor_parallel_degree"] = args.tp
os.environ.setdefault("SM_HP_MP_PARAMETERS", json.dumps(cfg))
os.environ.setdefault("SM_FRAMEWORK_PARAMS", json.dumps({"sagemaker_mpi_enabled": True}))

import smdistributed.modelparallel.torch as smp  # noqa: E402 - after the environment above
import transformers as hf  # noqa: E402

from mp.hf_trainer import SMPTrainer, SMPTrainingArguments  # noqa: E402

VOCAB, SEQ, CLASSES = 96, 16, 3


class Synthetic(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Class k draws its tokens from [k * 32, (k + 1) * 32): learnable from the tokens alone."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=gen)
        width = VOCAB // CLASSES
        self.ids = self.labels[:, None] * width + torch.randint(0, width, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class PrintLoss(hf.TrainerCallback):
    """Prints each logged training loss on rank 0 (the Trainer draws its own tqdm bar there)."""

    def on_log(self, args: object, state: hf.TrainerState, control: object, **kwargs: object) -> None:
        logs = kwargs.get("logs")
        if isinstance(logs, dict) and "loss" in logs:
            log_loss(state.is_world_process_zero, state.global_step, logs["loss"])


def main() -> int:
    hf.utils.logging.set_verbosity_error()
    config = hf.BertConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=2,
        intermediate_size=2 * args.hidden, max_position_embeddings=SEQ, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    # smp's way to ask for tensor parallelism: the supported modules created inside are replaced
    with smp.tensor_parallelism(enabled=args.tp > 1):
        model = hf.BertForSequenceClassification(config)

    training = SMPTrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, seed=0,
        report_to=[],
        save_strategy="no", dataloader_drop_last=True,  # every batch must divide into microbatches
    )  # fmt: skip
    trainer = SMPTrainer(
        model=model, args=training, train_dataset=Synthetic(args.samples, 0), eval_dataset=Synthetic(64, 1),
        callbacks=[PrintLoss()],
    )  # fmt: skip
    trainer.train()
    evaluation = trainer.evaluate()
    trainer.save_model(os.path.join(args.out, "final"))  # one HF checkpoint of the whole model

    rank0 = trainer.is_world_process_zero()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank0:
        print(
            f"BERT via the Trainer on {trainer.args.parallel_mode.value}: pp={smp.pp_size()} x "
            f"tp={smp.tp_size()} x rdp={smp.rdp_size()} on {smp.size()} ranks; "
            f"eval_loss {evaluation['eval_loss']:.4f}",
            flush=True,
        )
    summary(rank0, losses)
    if rank0 and args.plot:
        plot_losses(args.plot, {"train": losses}, "BERT fine-tuning via the HF Trainer (mp)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
