"""User-side helpers for transformers' own Trainer on its smp path (``SM_HP_MP_PARAMETERS`` set), where
the installed transformers needs them. The Trainer's code stays as it is; these subclasses change only
what it gets wrong on that path:

- :class:`SMPTrainingArguments`: on a machine without CUDA, transformers' smp branch calls
  ``torch.cuda.set_device`` (and with ``use_cpu=True`` reaches an unbound ``device``); this returns the
  CPU instead. With CUDA it changes nothing.
- :class:`SMPTrainer`: transformers 5.x delays the optimizer on the smp path and then never creates it;
  this creates it right after ``smp.DistributedModel`` wraps the model (smp's order). Where the
  Trainer already has an optimizer (one passed in, or a version that creates it) it changes nothing.
  It also clips gradients by the norm of the whole model (``optimizer.clip_master_grads``, collective
  over the pipeline and TP groups) where the Trainer clips each pipeline stage by its own norm
  (``clip_grad_norm_(model.parameters())``; smp did the same outside fp16). And evaluation after
  training reuses the wrapped model, as transformers 4.x did (5.x wraps ``self.model`` a second time,
  which smp refuses with MultipleDistributedModelError), and the Trainer gets smp's optimizer back from
  inside accelerate's wrapper, which hides ``local_state_dict`` (called to save a checkpoint). To
  resume, it loads the checkpoint's ``model.safetensors`` (what 5.x saves) where 5.x asks
  ``smp.resume_from_checkpoint`` for a ``pytorch_model.bin`` it never writes. With several
  data-parallel replicas it gives each its share of the training data (a ``DistributedSampler`` over
  ``args.world_size``, i.e. smp's dp or rdp size, as transformers 4.x did): 5.x gives every replica
  the same batches. Its LR scheduler is made on the optimizer whose ``step()`` the Trainer calls, so
  torch does not warn that the scheduler stepped first.

Importing this module needs ``transformers`` (and ``accelerate``, which the Trainer needs).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils.import_utils import is_sagemaker_mp_enabled

from mp.model import DistributedModel

__all__ = ["SMPTrainer", "SMPTrainingArguments"]


class SMPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose device is the CPU on the smp path when there is no CUDA."""

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        if is_sagemaker_mp_enabled() and not torch.cuda.is_available():
            self._n_gpu = 0
            self.distributed_state = None
            return torch.device("cpu")
        return super()._setup_devices


class SMPTrainer(Trainer):
    """``Trainer`` that creates its optimizer once the smp path has wrapped the model."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if is_sagemaker_mp_enabled() and isinstance(self.model_wrapped, DistributedModel):
            return self.model_wrapped
        wrapped: nn.Module = super()._wrap_model(model, training, dataloader)
        # 5.x (create_optimizer(model)) never creates it on this path; 4.x creates it after wrapping
        takes_model = "model" in inspect.signature(self.create_optimizer).parameters
        if training and is_sagemaker_mp_enabled() and self.optimizer is None and takes_model:
            self.create_optimizer(wrapped)
        return wrapped

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)  # type: ignore[no-untyped-call]
        if is_sagemaker_mp_enabled():
            # 5.x wraps the smp optimizer in accelerate's, which hides smp's methods that the Trainer
            # itself calls on this path (local_state_dict when it saves a checkpoint)
            self.optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return prepared

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if is_sagemaker_mp_enabled() and optimizer is None:
            # 5.x makes the scheduler on accelerate's wrapper, whose step() the Trainer no longer calls
            # (_prepare_for_training): torch's scheduler then warns on every run that it stepped before
            # the optimizer. Make it on the user's optimizer, whose step() the Trainer calls (under
            # fp16/bf16 smp's optimizer wraps it: its step() steps the user's)
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = getattr(optimizer, "optimizer", optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        safe = os.path.join(resume_from_checkpoint, "model.safetensors")
        legacy = os.path.join(resume_from_checkpoint, "pytorch_model.bin")
        if is_sagemaker_mp_enabled() and os.path.isfile(safe) and not os.path.isfile(legacy):
            from safetensors.torch import load_file

            target = self.model_wrapped if isinstance(self.model_wrapped, DistributedModel) else self.model
            assert target is not None
            target.load_state_dict(load_file(safe, device="cpu"))  # deferred to the partition by smp
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _get_train_sampler(self, *args: Any) -> Any:  # 5.x passes the dataset, 4.x nothing
        sampler = super()._get_train_sampler(*args)
        dataset: Any = args[0] if args and args[0] is not None else self.train_dataset
        if not is_sagemaker_mp_enabled() or self.args.world_size == 1 or sampler is None:
            return sampler
        shuffle = not isinstance(sampler, torch.utils.data.SequentialSampler)
        return torch.utils.data.DistributedSampler(
            dataset,
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            shuffle=shuffle,
            seed=self.args.seed,
            drop_last=self.args.dataloader_drop_last,
        )

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if is_sagemaker_mp_enabled():
            optimizer: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
            return optimizer.clip_master_grads(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)  # type: ignore[no-untyped-call]
