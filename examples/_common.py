"""Small helpers the examples share: the progress bar, the loss line the tests read, the loss plot.

Nothing here is mp: each example's training code is in the example itself.
"""

from __future__ import annotations

import math
import sys

from tqdm import tqdm


def progress(total: int, rank0: bool, desc: str = "training") -> tqdm:  # type: ignore[type-arg]
    """A tqdm bar on rank 0 only (every rank would draw its own otherwise); call .update() per step."""
    return tqdm(total=total, desc=desc, unit="step", disable=not rank0, file=sys.stdout)


def log_loss(rank0: bool, step: int, loss: float, **extra: float) -> None:
    """One line per step on rank 0, 'step N loss X', written above the bar (tests read these lines)."""
    if rank0:
        more = "".join(f" {k} {v:.4f}" for k, v in extra.items())
        tqdm.write(f"step {step} loss {loss:.6f}{more}", file=sys.stdout)


def say(rank0: bool, text: str) -> None:
    """A line on rank 0, above the progress bar."""
    if rank0:
        tqdm.write(text, file=sys.stdout)


def summary(rank0: bool, losses: list[float]) -> None:
    if rank0 and losses:
        print(f"loss: {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step {len(losses)})", flush=True)
        if not all(math.isfinite(x) for x in losses):
            print("warning: a loss is not finite", flush=True)


def plot_losses(
    path: str, curves: dict[str, list[float]], title: str, reference: list[float] | None = None
) -> None:
    """Write a loss curve with matplotlib's Agg backend (no display needed); ``reference``, plain
    PyTorch's losses, is drawn wide and grey underneath, so that equal curves stay visible."""
    from matplotlib.figure import Figure  # a Figure made directly draws with Agg, whatever the backend

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    if reference is not None:
        ax.plot(range(1, len(reference) + 1), reference, "-", color="0.6", lw=4, label="plain PyTorch")
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, "o-", ms=3, lw=1.2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(curves) > 1 or reference is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"loss curve written to {path}", flush=True)
