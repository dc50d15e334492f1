"""The training loop shared by the target and the drafts: :func:`fit`.

Training is the one place where speculum mutates a module in place: ``fit`` updates the given
module's parameters and returns a :class:`TrainResult` value describing the run. Everything that
decides the run's numbers (the seed's window stream, the optimizer state, the step, the training
loss summed since the last evaluation) goes into the checkpoint, so an interrupted run resumed
from it ends where an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from jaxtyping import Int
from torch import Tensor, nn
from tqdm import tqdm

from speculum.training.data import TokenSplit, announce, heldout_windows, random_windows

__all__ = ["CHECKPOINT_SECONDS", "LossFn", "TrainResult", "fit", "learning_rate", "saved_progress"]

#: ``loss_fn(windows) -> (scalar loss, metrics)``; windows are int64 ``[batch, length]`` ids on
#: the training device. Metrics are averaged over the held-out windows at each evaluation.
LossFn = Callable[[Int[Tensor, "batch length"]], tuple[Tensor, dict[str, float]]]


@attrs.define(frozen=True)
class TrainResult:
    """What a :func:`fit` run did.

    ``train_loss`` is the mean training loss over the last evaluation interval and
    ``heldout_loss`` the held-out loss after the last step. ``history`` holds
    ``(step, mean training loss since the previous evaluation)`` at every evaluation,
    ``heldout_history`` ``(step, held-out loss)`` at every evaluation, starting with step 0
    (before any update). ``heldout_metrics`` are the loss function's metrics averaged over the
    held-out windows at the end; ``seconds`` is this call's wall time (a resumed run counts only
    its own part); ``step_seconds`` the time of one update, measured from the end of the
    update :data:`UNTIMED_STEPS` after the run's first to the end of the last, evaluations and
    checkpoints left out (0.0 for a run too short to time), so that a short run tells how
    many updates fit a time budget without its fixed costs.
    """

    steps: int
    train_loss: float
    heldout_loss: float
    history: tuple[tuple[int, float], ...]
    heldout_history: tuple[tuple[int, float], ...] = ()
    heldout_metrics: dict[str, float] = attrs.field(factory=dict)
    seconds: float = 0.0
    step_seconds: float = 0.0


#: Updates at the start of a run left out of ``TrainResult.step_seconds`` (allocator growth,
#: kernel autotuning, first-call compilation).
UNTIMED_STEPS = 5

#: Without ``checkpoint_every``, a checkpoint is saved after the first update that ends this many
#: seconds after the last save (or the run's start): an interrupt loses about a minute at most,
#: whatever a step costs.
CHECKPOINT_SECONDS = 60.0


def _synchronize(device: str) -> None:
    """Wait for queued device work, so that a host clock reading means it is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def learning_rate(step: int, *, steps: int, lr: float, warmup: int) -> float:
    """The learning rate of update ``step`` (1-based): linear warmup to ``lr`` over ``warmup``
    updates, then cosine decay to ``lr / 10`` at update ``steps``."""
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def fit(
    module: nn.Module,
    loss_fn: LossFn,
    split: TokenSplit,
    *,
    steps: int,
    batch_size: int,
    length: int,
    lr: float,
    warmup: int = 100,
    weight_decay: float = 0.0,
    device: str = "cpu",
    seed: int = 0,
    checkpoint: Path | None = None,
    checkpoint_every: int | None = None,
    eval_every: int = 200,
    eval_batches: int = 8,
    progress: bool = True,
    grad_clip: float = 1.0,
    autocast: torch.dtype | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> TrainResult:
    """Train ``module`` in place for ``steps`` AdamW updates of ``loss_fn`` on windows of
    ``split.train``; return the run's :class:`TrainResult`.

    Each update draws ``batch_size`` windows of ``length`` ids (:func:`random_windows`, from a
    CPU generator seeded with ``seed``), moves them to ``device`` and steps AdamW (betas 0.9,
    0.95; ``weight_decay`` on matrices only, not on norms and biases) over the module's
    parameters that require grad, after clipping the gradient norm to ``grad_clip`` (0: off),
    at :func:`learning_rate`. Every ``eval_every`` updates and after the last, the held-out
    loss is the mean of ``loss_fn`` over the first ``eval_batches`` batches of
    :func:`heldout_windows`, without gradients and with the module in eval mode.

    With ``checkpoint``, the module, optimizer, step, window generator, history and the
    training loss summed since the last evaluation are saved there (written to a temporary
    file, then renamed) every ``checkpoint_every`` updates, or with ``None`` after the first
    update ending :data:`CHECKPOINT_SECONDS` of ``clock`` after the last save, and after the
    last update. A run that finds the file resumes from it; a checkpoint written with other
    options is refused (``checkpoint_every`` is not one of them: it changes no number).
    ``autocast`` runs ``loss_fn`` under ``torch.autocast`` with that dtype. ``progress`` shows a
    progress bar with the losses and the time left on stderr, after a ``resuming from step N``
    line when the run resumes.
    """
    options = {
        "steps": steps,
        "batch_size": batch_size,
        "length": length,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "seed": seed,
        "eval_every": eval_every,
        "eval_batches": eval_batches,
        "grad_clip": grad_clip,
    }
    _validate(options, device)
    if checkpoint_every is not None and (
        not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
        raise ValueError(
            f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}; leave it out "
            f"to save every {CHECKPOINT_SECONDS:.0f} s"
        )
    started = time.perf_counter()
    module.to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the module has no parameter that requires grad, so there is nothing to train; "
            "call module.requires_grad_(True) first"
        )
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    heldout = heldout_windows(split.heldout, batch_size, length, eval_batches)
    kind = torch.device(device).type

    def run_loss(windows: Tensor) -> tuple[Tensor, dict[str, float]]:
        context = torch.autocast(kind, dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            return loss_fn(windows.to(device))

    def evaluate() -> tuple[float, dict[str, float]]:
        module.eval()
        total, sums = 0.0, {}
        with torch.no_grad():
            for windows in heldout:
                loss, metrics = run_loss(windows)
                rows = len(windows)
                total += float(loss) * rows
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * rows
        module.train()
        count = sum(len(w) for w in heldout)
        return total / count, {name: value / count for name, value in sums.items()}

    step, history, heldout_history = 0, [], []
    # The training loss summed over the updates since the last evaluation, and their count.
    # Accumulated on the device: reading the loss every step would sync a GPU every step.
    running, interval = torch.zeros((), device=device), 0
    if checkpoint is not None and Path(checkpoint).is_file():
        state = _load(Path(checkpoint), options, device)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["rng"])
        step = state["step"]
        history = [tuple(h) for h in state["history"]]
        heldout_history = [tuple(h) for h in state["heldout_history"]]
        # A checkpoint written before these were saved was written at an evaluation, where
        # the sum is empty.
        running = state.get("running", running).to(device)
        interval = state.get("interval", 0)
        announce(f"resuming from step {step} of {steps} ({checkpoint})", enabled=progress)
    module.train()
    metrics: dict[str, float] | None = None
    resumed = step
    timed_from = resumed + UNTIMED_STEPS  # the clock starts when this update has finished
    clock_start, paused = None, 0.0
    saved_at = clock()
    with tqdm(
        total=steps,
        initial=resumed,
        desc="training",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        if not heldout_history:
            bar.set_postfix_str("held-out loss before training...")
            heldout_history.append((0, evaluate()[0]))
        bar.set_postfix_str(_losses(history, heldout_history))
        for step in range(resumed + 1, steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps=steps, lr=lr, warmup=warmup)
            loss, _ = run_loss(random_windows(split.train, batch_size, length, generator))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()
            running += loss.detach().float()
            interval += 1
            if step == timed_from:
                _synchronize(device)
                clock_start = time.perf_counter()
            evaluating = step % eval_every == 0 or step == steps
            saving = checkpoint is not None and (
                step == steps
                or (
                    step % checkpoint_every == 0
                    if checkpoint_every is not None
                    else clock() - saved_at >= CHECKPOINT_SECONDS
                )
            )
            if evaluating or saving:
                # The updates so far count as update time; evaluating and saving do not.
                _synchronize(device)
                pause = time.perf_counter()
                if evaluating:
                    train_loss = float(running) / interval
                    if not math.isfinite(train_loss):
                        raise RuntimeError(
                            f"the training loss became {train_loss} by step {step}; lower the "
                            f"learning rate (now {lr}) or raise the warmup (now {warmup})"
                        )
                    held, metrics = evaluate()
                    history.append((step, train_loss))
                    heldout_history.append((step, held))
                    running.zero_()
                    interval = 0
                    bar.set_postfix_str(_losses(history, heldout_history), refresh=False)
                if saving:
                    _save(
                        Path(checkpoint),
                        module,
                        optimizer,
                        generator,
                        step,
                        options,
                        history,
                        heldout_history,
                        running,
                        interval,
                    )
                    saved_at = clock()
                if clock_start is not None:
                    paused += time.perf_counter() - pause
            bar.update()
    step_seconds = 0.0
    if clock_start is not None and steps > timed_from:
        _synchronize(device)
        timed = time.perf_counter() - clock_start - paused
        step_seconds = timed / (steps - timed_from)
    if metrics is None:  # resumed from a checkpoint of the finished run: nothing was evaluated
        _, metrics = evaluate()
    return TrainResult(
        steps=steps,
        train_loss=history[-1][1],
        heldout_loss=heldout_history[-1][1],
        history=tuple(history),
        heldout_history=tuple(heldout_history),
        heldout_metrics=metrics,
        seconds=time.perf_counter() - started,
        step_seconds=step_seconds,
    )


def _validate(options: dict[str, Any], device: str) -> None:
    """Raise ``ValueError`` naming the first impossible option."""
    for name in ("steps", "batch_size", "length", "eval_every", "eval_batches"):
        if not isinstance(options[name], int) or options[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {options[name]!r}")
    if not options["lr"] > 0:
        raise ValueError(f"lr must be > 0, got {options['lr']!r}")
    for name in ("warmup", "weight_decay", "grad_clip"):
        if not options[name] >= 0:
            raise ValueError(f"{name} must be >= 0, got {options[name]!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"unknown device {device!r}: use cpu or cuda ({err})") from err
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda needs a CUDA GPU and none is visible; use --device cpu")


def _losses(history: list, heldout_history: list) -> str:
    """The progress bar's note: the latest training and held-out losses."""
    train = f"{history[-1][1]:.4f}" if history else "-"
    held = f"{heldout_history[-1][1]:.4f}" if heldout_history else "-"
    return f"train loss {train}, held-out loss {held}"


def _save(
    path: Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    step: int,
    options: dict[str, Any],
    history: list,
    heldout_history: list,
    running: Tensor,
    interval: int,
) -> None:
    """Write the resumable state to ``path`` atomically (temporary file, then rename)."""
    state = {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": generator.get_state(),
        "step": step,
        "options": options,
        "history": history,
        "heldout_history": heldout_history,
        "running": running,
        "interval": interval,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def _read(path: Path, device: str, *, mmap: bool = False) -> dict[str, Any]:
    """The state saved at ``path``, its tensors on ``device`` (with ``mmap``, CPU tensors
    mapped from the file and read only when touched)."""
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises several unrelated types for damaged files
        raise ValueError(
            f"cannot read checkpoint {path}: {err}; delete it to start training over"
        ) from err


def saved_progress(path: Path) -> tuple[int, int] | None:
    """``(step, steps)`` of the checkpoint at ``path``: the update a rerun resumes after, of
    how many; ``None`` when there is no checkpoint yet. Cheap: the file is memory-mapped and
    its weights are not read."""
    path = Path(path)
    if not path.is_file():
        return None
    state = _read(path, "cpu", mmap=True)
    return state["step"], state["options"]["steps"]


def _load(path: Path, options: dict[str, Any], device: str) -> dict[str, Any]:
    """The state saved at ``path``, refused if it was written with other ``options``."""
    state = _read(path, device)
    saved = state["options"]
    changed = [
        f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in options.items() if saved.get(k) != v
    ]
    if changed:
        raise ValueError(
            f"checkpoint {path} belongs to a run with other options ({'; '.join(changed)}); "
            "rerun with the same options to resume it, or delete it to start over"
        )
    state["rng"] = state["rng"].cpu()
    return state
