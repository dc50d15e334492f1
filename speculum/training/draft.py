"""Train a draft for any target speculum loads, measure its acceptance, and save it.

:func:`train_draft` (``speculum train-draft``) loads the target, tokenizes a corpus with the
target's own tokenizer (the target's ``corpus/`` when ``train-target`` made it, else the
interpreter's installed ``.py`` files, or the files given), builds a fresh draft with the
algorithm's :class:`~speculum.training.recipes.Recipe`, trains it with
:func:`~speculum.training.loop.fit` against the frozen target, reads the saved draft back with
speculum's loader and measures its acceptance length by greedy speculative generation on
held-out prompts (:func:`measure_acceptance`).

While training, the resumable checkpoint lives in the sibling work folder ``OUT_DIR.work``
(saved about every minute, or every ``checkpoint_every`` steps; rerunning the same command
resumes). The finished draft is written to the hidden sibling
``.OUT_DIR.staging`` and renamed to ``OUT_DIR`` at the very end, then the work folder is
removed: an interrupted run never leaves a folder that looks like a finished draft. Besides the
algorithm's checkpoint files (see ``docs/training_drafts.md``) the folder holds the target's
``tokenizer.json`` and ``training.json`` (options and the returned metrics).
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor, nn

from speculum.models.config import UnsupportedModel
from speculum.models.decoder import DecoderModel
from speculum.models.draft_loading import DraftTargetMismatch
from speculum.models.loading import DTYPES, CheckpointError, cast_weights, load_model
from speculum.models.standalone import VocabularyMismatch
from speculum.models.tokenizer import EOS, TOKENIZER_FILE, load_tokenizer
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import acceptance_stats, generate
from speculum.training.corpus import installed_python_files, sample_files
from speculum.training.data import (
    HELDOUT_FILE,
    TRAIN_FILE,
    TokenSplit,
    announce,
    heldout_windows,
    load_split,
    random_windows,
    special_id,
    tokenize_split,
)
from speculum.training.loop import fit
from speculum.training.recipes import DraftOptions, Recipe, recipe
from speculum.training.target import checkpoint_file, claim_work_dir, work_dir

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TREE",
    "measure_acceptance",
    "train_draft",
]

#: Bytes of installed ``.py`` files sampled when neither ``files`` nor a target corpus is given.
DEFAULT_MAX_BYTES = 4_000_000
#: Acceptance is measured on this many held-out prompts of this many tokens, each continued
#: by this many greedy tokens.
NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 64, 64
#: EAGLE-3 drafts are also measured drafting a tree: 5 steps, top-4 per node, 16 tree nodes
#: (root included) verified per round.
TREE = SpecOptions(num_steps=5, topk=4, num_draft_tokens=16)


def train_draft(
    *,
    target_dir: str | Path,
    algorithm: str,
    out_dir: str | Path,
    steps: int = 2000,
    batch_size: int = 8,
    length: int = 256,
    lr: float = 1e-3,
    device: str = "cpu",
    seed: int = 0,
    files: Sequence[str | Path] | None = None,
    num_steps: int = 3,
    draft_vocab_size: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    standalone_size: tuple[int, int] | None = None,
    distill: bool = True,
    chain_hidden: bool = True,
    save_dtype: str | None = None,
    block_size: int | None = None,
    checkpoint_every: int | None = None,
) -> dict[str, float]:
    """Train an ``algorithm`` draft for the target in ``target_dir`` and save it as ``out_dir``.

    ``steps`` AdamW updates on ``batch_size`` windows of ``length`` tokens at peak learning
    rate ``lr`` (warmup: a tenth of the steps, at most 100). ``num_steps`` is the drafting
    depth (EAGLE-3's training-time-test depth, multi-layer EAGLE's layer count) and the chain
    length acceptance is measured with; ``draft_vocab_size`` is EAGLE-3's reduced vocabulary;
    ``standalone_size``, ``distill`` and ``chain_hidden`` are the
    :class:`~speculum.training.recipes.DraftOptions` of the same names, as is ``block_size``
    (DFLASH and DSPARK: the block width the draft is trained and measured with). ``files``
    replaces the corpus (see the module docstring). Recipes marked ``on_policy`` (DFLASH,
    DSPARK) train on the target's greedy continuations of prompts from the corpus instead
    (:func:`target_split`), held-out side included. A resumable checkpoint is saved every
    ``checkpoint_every`` steps, by default about once a minute
    (:func:`~speculum.training.loop.fit`). ``progress`` names each phase on stderr and shows a
    progress bar while training.

    Returns the metrics, also written to ``out_dir/training.json``: ``acceptance_length``
    (tokens per verify step, bonus token included, greedy chains of ``num_steps``),
    ``accept_rate_d`` (rounds that accepted depth ``d``), for EAGLE-3 also
    ``acceptance_length_tree`` (:data:`TREE`), ``train_loss``, ``heldout_loss`` and the loss's
    held-out metrics as ``heldout_<name>``, ``train_seconds``, ``measure_seconds``,
    ``parameters`` (trained) and ``draft_vocab_size``.

    Raises ``ValueError`` for an unknown algorithm or impossible options, ``CheckpointError``
    when the target cannot be loaded, :class:`DraftTargetMismatch` when ``out_dir`` holds a
    draft of another target, and ``ValueError`` when it holds anything else and ``overwrite``
    is not set. ``save_dtype`` (e.g. ``"bfloat16"``) stores the draft's weights in that dtype
    (they load in the target's); acceptance is measured on what was stored.
    """
    if save_dtype is not None and save_dtype not in DTYPES:
        raise ValueError(f"save_dtype {save_dtype!r}: choose one of {', '.join(DTYPES)}")
    chosen = recipe(algorithm)
    options = DraftOptions(
        num_steps=num_steps,
        draft_vocab_size=draft_vocab_size,
        seed=seed,
        standalone_size=standalone_size,
        distill=distill,
        chain_hidden=chain_hidden,
        block_size=block_size,
    )
    shape = {
        "num_steps": num_steps,
        "draft_vocab_size": draft_vocab_size,
        "standalone_size": None if standalone_size is None else list(standalone_size),
        "distill": distill,
        "chain_hidden": chain_hidden,
        "block_size": block_size,
        "files": None if files is None else sorted(str(f) for f in files),
        "seed": seed,
    }
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = _load_target(target_dir, device)
    if not 2 <= length <= target.config.max_position_embeddings:
        raise ValueError(
            f"length {length} is out of range: a window must hold at least 2 tokens and fit the "
            f"target's {target.config.max_position_embeddings} positions"
        )
    _check_out_dir(chosen, out_dir, target_dir, target, overwrite)
    split = _corpus(target_dir, target, files, seed, progress)
    work = work_dir(out_dir)
    claim_work_dir(
        work,
        {
            "target_dir": str(target_dir.absolute()),
            "algorithm": chosen.name,
            **shape,
        },
    )
    if chosen.on_policy:
        split = target_split(target, split, steps * batch_size, length, seed, progress)
    announce(
        f"training a {chosen.name} draft for {target_dir} on {split.train.size:,} tokens "
        f"({split.heldout.size:,} held out)",
        enabled=progress,
    )
    head = chosen.build(target, options, split)
    result = fit(
        head,
        partial(chosen.loss, head, target, options=options),
        split,
        steps=steps,
        batch_size=batch_size,
        length=length,
        lr=lr,
        warmup=min(100, max(1, steps // 10)),
        device=device,
        seed=seed,
        checkpoint=checkpoint_file(out_dir),
        checkpoint_every=checkpoint_every,
        eval_every=min(200, steps),
        progress=progress,
    )
    metrics = {
        "train_loss": result.train_loss,
        "heldout_loss": result.heldout_loss,
        **{f"heldout_{name}": value for name, value in result.heldout_metrics.items()},
        "train_seconds": result.seconds,
        "step_seconds": result.step_seconds,
        "parameters": float(sum(p.numel() for p in head.parameters() if p.requires_grad)),
        "draft_vocab_size": float(head.draft_vocab_size),
    }
    staging = out_dir.with_name(f".{out_dir.name}.staging")
    if staging.exists():  # left by a run that died while publishing
        shutil.rmtree(staging)
    try:
        chosen.save(head.eval().requires_grad_(False), staging)
        if save_dtype is not None:
            cast_weights(staging, DTYPES[save_dtype])
        if (target_dir / TOKENIZER_FILE).is_file():
            shutil.copyfile(target_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
        # Measure what was saved, read back by the loader the engine uses.
        saved = chosen.load(staging, target)
        start = time.perf_counter()
        prompts = _prompts(split, target)
        shapes = "chains, then trees" if chosen.name == "eagle3" else "chains"
        announce(
            f"measuring acceptance: {len(prompts)} held-out prompts, {NEW_TOKENS} greedy tokens "
            f"each, drafted as {shapes}...",
            enabled=progress,
        )
        spec = SpecOptions(num_steps=num_steps, chain_hidden=chain_hidden)
        metrics |= measure_acceptance(target, saved, chosen.name, prompts, spec)
        if chosen.name == "eagle3":
            tree = measure_acceptance(target, saved, chosen.name, prompts, TREE)
            metrics["acceptance_length_tree"] = tree["acceptance_length"]
        metrics["measure_seconds"] = time.perf_counter() - start
        record = {
            "target_dir": str(target_dir.absolute()),
            "algorithm": chosen.name,
            "options": {
                "steps": steps,
                "batch_size": batch_size,
                "length": length,
                "lr": lr,
                **shape,
                "train_tokens": int(split.train.size),
                "heldout_tokens": int(split.heldout.size),
            },
            "metrics": metrics,
            "heldout_history": result.heldout_history,
        }
        (staging / "training.json").write_text(json.dumps(record, indent=1))
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(work)
    described = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
    announce(f"saved {out_dir}: {described}", enabled=progress)
    return metrics


#: On-policy data: at most this many continuations for training (and an eighth of it, at
#: least 8, for the held-out side), generated this many at a time.
MAX_CONTINUATIONS, CONTINUATION_BATCH = 128, 64


def target_continuations(
    target: DecoderModel, tokens: np.ndarray, count: int, length: int, seed: int
) -> np.ndarray:
    """``count`` sequences of ``length`` tokens, concatenated with the target's EOS (or the
    last id) after each: a quarter from a random window of ``tokens``, the rest the target's
    greedy continuation of it (EOS ignored), generated with speculum's plain decoding."""
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
    prompt = max(1, length // 4)
    new_tokens = max(1, length - prompt)
    generator = torch.Generator().manual_seed(seed)
    prompts = random_windows(tokens, count, prompt, generator).tolist()
    engine = engine_from_model(
        target, max_batch=min(count, CONTINUATION_BATCH), max_context=prompt + new_tokens + 1
    )
    results = generate(prompts, engine=engine, max_new_tokens=new_tokens, ignore_eos=True)
    pieces = [np.array([*p, *r.token_ids, eos], dtype=np.int32) for p, r in zip(prompts, results)]
    return np.concatenate(pieces)


def target_split(
    target: DecoderModel,
    split: TokenSplit,
    windows: int,
    length: int,
    seed: int,
    progress: bool,
) -> TokenSplit:
    """The on-policy split of a run that draws ``windows`` windows of ``length`` tokens: the
    target's continuations of prompts from each side of ``split`` (:func:`target_continuations`;
    about a quarter of the windows the run draws, at most :data:`MAX_CONTINUATIONS`)."""
    train = min(MAX_CONTINUATIONS, max(8, windows // 4))
    heldout = max(8, train // 8)
    announce(
        f"generating {train + heldout} greedy continuations of {length} tokens with the target...",
        enabled=progress,
    )
    return TokenSplit(
        train=target_continuations(target, split.train, train, length, seed),
        heldout=target_continuations(target, split.heldout, heldout, length, seed + 1),
    )


def measure_acceptance(
    target: DecoderModel,
    head: nn.Module,
    algorithm: str,
    prompts: Int[Tensor, "prompts length"],
    spec: SpecOptions,
    max_new_tokens: int = NEW_TOKENS,
) -> dict[str, float]:
    """Greedy speculative generation of ``max_new_tokens`` per prompt (EOS ignored, so every
    prompt runs as long), all prompts batched: ``acceptance_length`` is the tokens emitted per
    verify round, bonus token included (SGLang's convention), over all rounds of all prompts;
    ``accept_rate_d`` the fraction of rounds that accepted draft depth ``d``."""
    context = min(target.config.max_position_embeddings, prompts.shape[1] + max_new_tokens + 1)
    engine = engine_from_model(
        target,
        algorithm=algorithm,
        draft=head,
        spec=spec,
        max_batch=len(prompts),
        max_context=context,
    )
    results = generate(
        [row.tolist() for row in prompts],
        engine=engine,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
    )
    # Padded to a round's most tokens (num_steps drafts and the bonus), so that every depth
    # gets a rate, zero included.
    histograms = [[0] * (spec.num_steps + 2)]
    histograms += [r.stats["accept_length_histogram"] for r in results]
    total = [sum(c) for c in itertools.zip_longest(*histograms, fillvalue=0)]
    stats = acceptance_stats(total)
    rates = stats["accept_rate_per_position"]
    return {
        "acceptance_length": float(stats["accept_length_mean"]),
        **{f"accept_rate_{depth + 1}": float(rate) for depth, rate in enumerate(rates)},
    }


def _load_target(target_dir: Path, device: str) -> DecoderModel:
    """The frozen target, or a ``CheckpointError`` saying what is wrong with the folder."""
    try:
        target = load_model(target_dir, device=device)
    except (CheckpointError, UnsupportedModel) as err:
        raise CheckpointError(
            f"cannot load the target model to train a draft for: {err}. Pass --target a "
            "Hugging Face model folder speculum runs (config.json, *.safetensors, "
            "tokenizer.json)"
        ) from err
    return target.eval().requires_grad_(False)


def _check_out_dir(
    chosen: Recipe, out_dir: Path, target_dir: Path, target: DecoderModel, overwrite: bool
) -> None:
    """Refuse an ``out_dir`` that is the target itself, or (without ``overwrite``) holds a
    draft of another target, a finished draft, or anything else."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a folder; choose another output folder")
    if target_dir.exists() and out_dir.absolute().resolve() == target_dir.absolute().resolve():
        raise ValueError(
            f"the output folder {out_dir} is the target's own folder, which training would "
            "replace; choose another output folder"
        )
    if overwrite or not out_dir.exists() or not any(out_dir.iterdir()):
        return
    replace = "pass --overwrite (overwrite=True) to replace it, or choose another output folder"
    try:
        chosen.load(out_dir, target)
    except (DraftTargetMismatch, VocabularyMismatch) as err:
        raise DraftTargetMismatch(
            f"{out_dir} holds a {chosen.name} draft trained for a different target ({err}); "
            f"{replace}"
        ) from err
    except (CheckpointError, UnsupportedModel, ValueError) as err:
        raise ValueError(
            f"{out_dir} exists and does not hold a {chosen.name} draft ({err}); {replace}"
        ) from err
    raise ValueError(
        f"{out_dir} already holds a trained {chosen.name} draft for this target; {replace}"
    )


def _corpus(
    target_dir: Path,
    target: DecoderModel,
    files: Sequence[str | Path] | None,
    seed: int,
    progress: bool,
) -> TokenSplit:
    """The token split to train on: ``files``, else the target's own ``corpus/`` (the exact
    tokens it was trained on), else a sample of the installed ``.py`` files, tokenized with the
    target's tokenizer; checked against the target's vocabulary."""
    own = target_dir / "corpus"
    if files is None and (own / TRAIN_FILE).is_file() and (own / HELDOUT_FILE).is_file():
        announce(f"reading the target's corpus in {own}", enabled=progress)
        split = load_split(own)
    else:
        if not (target_dir / TOKENIZER_FILE).is_file():
            raise CheckpointError(
                f"{target_dir} has no {TOKENIZER_FILE}: the corpus is tokenized with the "
                "target's own tokenizer, so save it with the model "
                "(transformers: tokenizer.save_pretrained(folder))"
            )
        tokenizer = load_tokenizer(target_dir)
        eos = target.config.eos_token_ids
        separator = eos[0] if eos else special_id(tokenizer, EOS)
        described = "the installed .py files" if files is None else f"{len(files)} files"
        announce(
            f"reading and tokenizing {described} with the target's tokenizer...", enabled=progress
        )
        chosen = (
            sample_files(installed_python_files(), DEFAULT_MAX_BYTES, seed)
            if files is None
            else [Path(f) for f in files]
        )
        split = tokenize_split(tokenizer, chosen, separator, seed)
    vocab = target.config.vocab_size
    largest = max(int(split.train.max(initial=0)), int(split.heldout.max(initial=0)))
    if largest >= vocab:
        raise ValueError(
            f"the corpus holds token id {largest} but the target's vocabulary has {vocab} ids: "
            f"{target_dir}'s tokenizer does not belong to its model"
        )
    return split


def _prompts(split: TokenSplit, target: DecoderModel) -> Int[Tensor, "prompts length"]:
    """Up to :data:`NUM_PROMPTS` held-out prompts of up to :data:`PROMPT_TOKENS` tokens (fewer
    when the held-out text or the target's context is short)."""
    room = target.config.max_position_embeddings // 2
    length = max(1, min(PROMPT_TOKENS, room, len(split.heldout) // NUM_PROMPTS))
    return heldout_windows(split.heldout, NUM_PROMPTS, length, 1)[0]


def _publish(staging: Path, out_dir: Path) -> None:
    """Rename the finished ``staging`` folder to ``out_dir``; an old ``out_dir`` is moved aside
    first and deleted last, so that at every moment one complete folder is in place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if not out_dir.exists():
        staging.replace(out_dir)
        return
    replaced = out_dir.with_name(f".{out_dir.name}.replaced")
    if replaced.exists():
        shutil.rmtree(replaced)
    out_dir.replace(replaced)
    staging.replace(out_dir)
    shutil.rmtree(replaced)
