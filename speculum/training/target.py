"""Train speculum's own target: a small Llama code model, saved as a Hugging Face folder.

:func:`train_target` samples the interpreter's installed ``.py`` files, trains a byte-level BPE
tokenizer on them, trains a ``LlamaForCausalLM`` of one of the :data:`SIZES` with next-token
cross-entropy (:func:`next_token_loss` through :func:`~speculum.training.loop.fit`) and writes
``OUT_DIR``::

    config.json, model.safetensors   the model (transformers' LlamaForCausalLM loads it as is)
    tokenizer.json                    the tokenizer (ids 0 and 1 are <s> and </s>)
    training.json                     options, parameter count, losses, wall time
    corpus/                           tokenizer.json, train.npy, heldout.npy, corpus.json: the
                                      exact tokens, reused by ``train-draft``

While training, everything lives in the sibling work folder ``OUT_DIR.work`` (the corpus in
``corpus/`` unless ``corpus_dir`` says otherwise, the resumable ``checkpoint.pt``). The finished
model is written to a hidden sibling and renamed to ``OUT_DIR`` at the very end, then the work
folder is removed: an interrupted run never leaves a folder that looks like a model, and
rerunning the same command resumes from the last checkpoint (saved about every minute, or every
``checkpoint_every`` steps).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from speculum.models.config import DecoderConfig
from speculum.models.decoder import DecoderModel, dense_batch
from speculum.models.loading import DTYPES, cast_weights, save_model
from speculum.models.tokenizer import BOS, EOS, TOKENIZER_FILE, Tokenizer
from speculum.training.data import announce, prepare_corpus, special_id
from speculum.training.loop import TrainResult, fit

__all__ = [
    "SIZES",
    "checkpoint_file",
    "claim_work_dir",
    "init_model",
    "next_token_loss",
    "target_config",
    "train_target",
    "work_dir",
]

#: Shapes of the target presets (the vocabulary comes from the tokenizer). ``tiny`` is about
#: 6.5M parameters with an 8192-id vocabulary, ``small`` about 28M, ``test`` a few ten
#: thousand (for tests). Intermediate sizes are ~2.75x the width, rounded to a multiple of 8.
SIZES: dict[str, dict[str, int]] = {
    "test": {
        "hidden_size": 32,
        "intermediate_size": 88,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
    },
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_layers": 6,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 1024,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
    },
}

#: Weight scale of the initial matrices and embeddings (GPT-2's).
_INIT_STD = 0.02


def target_config(size: str, tokenizer: Tokenizer) -> DecoderConfig:
    """The Llama config of preset ``size`` over ``tokenizer``'s vocabulary, BOS and EOS ids
    (tied embeddings, float32)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return DecoderConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tokenizer.vocab_size,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
        eos_token_ids=(special_id(tokenizer, EOS),),
        bos_token_id=special_id(tokenizer, BOS),
        dtype="float32",
        **SIZES[size],
    )


def init_model(config: DecoderConfig, *, seed: int) -> DecoderModel:
    """A trainable decoder: normal(0, 0.02) matrices and embeddings, the residual-branch
    outputs (``o_proj``, ``down_proj``) scaled down by ``sqrt(2 * layers)`` so the residual
    stream starts at the same scale whatever the depth (GPT-2's rule), unit norms."""
    generator = torch.Generator().manual_seed(seed)
    model = DecoderModel(config)
    residual_std = _INIT_STD / (2 * config.num_layers) ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = (
                    residual_std
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else _INIT_STD
                )
                param.normal_(0.0, std, generator=generator)
    return model.requires_grad_(True)


def next_token_loss(
    model: DecoderModel, windows: Int[Tensor, "batch length"]
) -> tuple[Tensor, dict[str, float]]:
    """Mean cross-entropy of predicting ``windows[:, 1:]`` from ``windows[:, :-1]`` (one causal,
    cache-free forward), and, in eval mode only, the top-1 ``accuracy`` (reading it costs a
    device sync, which training steps skip)."""
    hidden, _ = model(dense_batch(windows[:, :-1]), None)
    logits = model.logits(hidden)
    targets = windows[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if model.training:
        return loss, {}
    return loss, {"accuracy": float((logits.argmax(-1) == targets).float().mean())}


def work_dir(out_dir: Path) -> Path:
    """The sibling folder holding a run's corpus and checkpoint until ``out_dir`` is done."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".work")


def checkpoint_file(out_dir: Path) -> Path:
    """Where a training run for ``out_dir`` keeps its resumable checkpoint until it is done."""
    return work_dir(out_dir) / "checkpoint.pt"


def train_target(
    out_dir: Path,
    *,
    size: str = "tiny",
    corpus_dir: Path | None = None,
    max_bytes: int = 8_000_000,
    vocab_size: int = 8192,
    steps: int = 2000,
    batch_size: int = 16,
    length: int = 256,
    lr: float = 2e-3,
    device: str = "cpu",
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    files: Sequence[Path] | None = None,
    overwrite: bool = False,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    eval_every: int = 200,
    save_dtype: str | None = None,
    checkpoint_every: int | None = None,
) -> TrainResult:
    """Train a target model of preset ``size`` and save it, complete, as ``out_dir``.

    The corpus is ``files`` (default: the interpreter's installed ``.py`` files) sampled to
    ``max_bytes`` with ``seed``; the tokenizer has ``vocab_size`` ids. Each step trains on
    ``batch_size`` windows of ``length`` tokens (``length - 1`` predictions each) at peak
    learning rate ``lr`` after ``warmup`` steps (default: a tenth of ``steps``, at most 100).
    ``corpus_dir`` (default ``OUT_DIR.work/corpus``) is where the tokenizer and token arrays are
    built, or reused if already there. See the module docstring for the files written.

    With ``resume`` (the default) a checkpoint left by an interrupted run with the same options
    is continued; ``resume=False`` starts over. Checkpoints are saved every ``checkpoint_every``
    steps, by default about once a minute (:func:`~speculum.training.loop.fit`). ``progress``
    names each phase on stderr and shows a progress bar while training. ``out_dir`` must not
    hold a finished model unless ``overwrite``. ``save_dtype`` (e.g. ``"bfloat16"``) stores the
    finished weights in that dtype; ``config.json`` keeps float32, the dtype loaders compute in
    by default.
    """
    if save_dtype is not None and save_dtype not in DTYPES:
        raise ValueError(f"save_dtype {save_dtype!r}: choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    _check_out_dir(out_dir, overwrite)
    work = work_dir(out_dir)
    if not resume and work.exists():
        shutil.rmtree(work)
    options: dict[str, Any] = {
        "size": size,
        "corpus_dir": None if corpus_dir is None else str(corpus_dir),
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "files": None if files is None else sorted(str(f) for f in files),
        "seed": seed,
    }
    claim_work_dir(work, options)
    corpus = work / "corpus" if corpus_dir is None else Path(corpus_dir)
    tokenizer, split = prepare_corpus(
        corpus,
        max_bytes=max_bytes,
        vocab_size=vocab_size,
        seed=seed,
        files=files,
        progress=progress,
    )
    config = target_config(size, tokenizer)
    if not 2 <= length <= config.max_position_embeddings + 1:
        raise ValueError(
            f"length {length} is out of range: a window of length L trains L - 1 positions, "
            f"and size {size!r} has {config.max_position_embeddings}; use 2 <= --length <= "
            f"{config.max_position_embeddings + 1}"
        )
    model = init_model(config, seed=seed)
    announce(
        f"training a {size} model of {sum(p.numel() for p in model.parameters()):,} parameters "
        f"on {split.train.size:,} tokens ({split.heldout.size:,} held out)",
        enabled=progress,
    )
    result = fit(
        model,
        partial(next_token_loss, model),
        split,
        steps=steps,
        batch_size=batch_size,
        length=length,
        lr=lr,
        warmup=min(100, max(1, steps // 10)) if warmup is None else warmup,
        weight_decay=weight_decay,
        device=device,
        seed=seed,
        checkpoint=checkpoint_file(out_dir),
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        progress=progress,
    )
    summary = {
        **options,
        "steps": steps,
        "batch_size": batch_size,
        "length": length,
        "lr": lr,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": int(split.train.size),
        "heldout_tokens": int(split.heldout.size),
        "train_loss": result.train_loss,
        "heldout_loss": result.heldout_loss,
        "heldout_metrics": result.heldout_metrics,
        "heldout_history": result.heldout_history,
        "seconds": result.seconds,
        "step_seconds": result.step_seconds,
    }
    _publish(out_dir, model, corpus, summary, save_dtype)
    shutil.rmtree(work)
    return result


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an ``out_dir`` that holds anything, a finished model above all, unless
    ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a folder; choose another output folder")
    if overwrite or not out_dir.exists():
        return
    if (out_dir / "config.json").exists():
        raise ValueError(
            f"{out_dir} already holds a finished model; pass --overwrite (overwrite=True) to "
            "replace it, or choose another output folder"
        )
    if any(out_dir.iterdir()):
        raise ValueError(
            f"{out_dir} exists and is not empty; pass --overwrite (overwrite=True) to replace "
            "it, or choose another output folder"
        )


def claim_work_dir(work: Path, options: dict[str, Any]) -> None:
    """Create the work folder, or check that the run it belongs to had the same corpus and
    model options (the checkpoint checks the training options itself)."""
    record = work / "run.json"
    if record.is_file():
        before = json.loads(record.read_text())
        changed = [
            f"{k}: {before.get(k)!r} then, {v!r} now"
            for k, v in options.items()
            if before.get(k) != v
        ]
        if changed:
            raise ValueError(
                f"{work} holds an interrupted run with other options ({'; '.join(changed)}); "
                "rerun with the same options to resume it, or delete the folder to start over"
            )
        return
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(options, indent=1))


def _publish(
    out_dir: Path,
    model: DecoderModel,
    corpus: Path,
    summary: dict[str, Any],
    save_dtype: str | None = None,
) -> None:
    """Write the finished folder beside ``out_dir`` (weights in ``save_dtype`` if given) and
    rename it into place."""
    staging = out_dir.with_name(f".{out_dir.name}.staging")
    if staging.exists():  # left by a run that died while publishing
        shutil.rmtree(staging)
    save_model(model.eval().requires_grad_(False), staging)
    if save_dtype is not None:
        cast_weights(staging, DTYPES[save_dtype])
    shutil.copyfile(corpus / TOKENIZER_FILE, staging / TOKENIZER_FILE)
    shutil.copytree(corpus, staging / "corpus")
    (staging / "training.json").write_text(json.dumps(summary, indent=1))
    if out_dir.exists():
        # Move the old folder aside rather than deleting it first, so that at every moment
        # either the old or the new model is in place.
        replaced = out_dir.with_name(f".{out_dir.name}.replaced")
        if replaced.exists():
            shutil.rmtree(replaced)
        out_dir.replace(replaced)
        staging.replace(out_dir)
        shutil.rmtree(replaced)
    else:
        staging.replace(out_dir)
