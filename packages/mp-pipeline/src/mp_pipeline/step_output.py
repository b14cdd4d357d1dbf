"""StepOutput: one step-function return value across all microbatches (docs/pipeline.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mp_pipeline.errors import InvalidStepOutputError
from mp_pipeline.structure import map_structure

__all__ = ["StepOutput", "merge_microbatch_results"]


class StepOutput:
    """The per-microbatch versions of a tensor returned from an ``@smp.step`` function.

    ``outputs`` is the list (microbatch order); ``reduce_mean()`` averages them (``sum(x)/len(x)``),
    ``reduce_sum()`` sums them, ``concat()`` concatenates them along dim 0 and ``stack()`` stacks them.
    """

    def __init__(self, outputs: Sequence[Any]) -> None:
        if not isinstance(outputs, list | tuple):
            raise InvalidStepOutputError(
                f"StepOutput needs a list or tuple of per-microbatch outputs; got {type(outputs).__name__}. "
                "Fix: pass e.g. StepOutput([t0, t1])."
            )
        self.outputs: list[Any] = list(outputs)

    def reduce_mean(self) -> Any:
        """The mean over microbatches."""
        return self.reduce_sum() / len(self.outputs)

    def reduce_sum(self) -> Any:
        """The sum over microbatches."""
        total = self.outputs[0]
        for x in self.outputs[1:]:
            total = total + x
        return total

    def concat(self) -> torch.Tensor:
        """The microbatch outputs concatenated along dim 0 (the whole batch's output)."""
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """The microbatch outputs stacked along a new dim 0."""
        return torch.stack(self.outputs, dim=0)

    def detach(self) -> StepOutput:
        """The same outputs detached from autograd (smp's ``StepOutput.detach``; transformers'
        Trainer calls ``.detach().concat()`` on its smp path)."""
        return StepOutput([t.detach() if isinstance(t, torch.Tensor) else t for t in self.outputs])

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def __repr__(self) -> str:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in self.outputs]
        return f"StepOutput({len(self.outputs)} microbatches: {shapes})"


def _same_shape(values: list[Any]) -> bool:
    first = values[0]
    for v in values[1:]:
        if type(v) is not type(first):
            return False
        if isinstance(first, list | tuple) and len(v) != len(first):
            return False
        if isinstance(first, dict) and list(v.keys()) != list(first.keys()):
            return False
    return True


def _merge(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in values):
        return StepOutput(values)
    if not _same_shape(values):
        return list(values)
    if isinstance(first, list):
        return [_merge([v[i] for v in values]) for i in range(len(first))]
    if isinstance(first, tuple):
        items = [_merge([v[i] for v in values]) for i in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*items)
        return tuple(items)
    if isinstance(first, dict):
        merged = {k: _merge([v[k] for v in values]) for k in first}
        if type(first) is dict:
            return merged
        try:
            out = type(first)()
            for k, val in merged.items():
                out[k] = val
            return out
        except Exception:
            return merged
    return list(values)


def merge_microbatch_results(results: list[Any], *, detach: bool = True) -> Any:
    """Per-microbatch return values to smp's form: tensors become StepOutput leaves of the same
    structure (lists, tuples, dicts kept); other values a per-microbatch list."""
    if detach:
        results = [map_structure(r, lambda t: t.detach()) for r in results]
    return _merge(results)
