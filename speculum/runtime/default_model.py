"""The bundled default model, and the tiny random Llama that tests and examples build.

``speculum generate`` with no ``--model`` runs the bundled default: a tiny code model trained by
``speculum train-target`` on the Python source installed with the interpreter, with an EAGLE-3
draft trained for it by ``speculum train-draft`` (``speculum/assets/default``; how it was made
is in its ``training.json`` files and docs/training.md). It ships inside the package, so the
command works on a fresh machine with no download.
"""

from __future__ import annotations

from pathlib import Path

from speculum.models.config import DecoderConfig
from speculum.models.loading import random_model, save_model
from speculum.models.tokenizer import byte_level_tokenizer, save_tokenizer

__all__ = [
    "BUNDLED",
    "DEFAULT_ALGORITHM",
    "TINY_CONFIG",
    "default_draft_dir",
    "default_model_dir",
    "write_tiny_model",
]

#: Where the bundled default model lives: ``target/`` and its EAGLE-3 draft ``eagle3/``.
BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "default"
#: The algorithm the bundled default runs when none is asked for.
DEFAULT_ALGORITHM = "eagle3"

#: A 4-layer, 128-wide Llama over the byte-level tokenizer's 258 ids (about 0.9M parameters).
TINY_CONFIG = DecoderConfig(
    architecture="LlamaForCausalLM",
    vocab_size=258,
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    sliding_window=None,
    eos_token_ids=(257,),
    bos_token_id=256,
    dtype="float32",
)


def write_tiny_model(folder: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny random model and its byte-level tokenizer to ``folder``."""
    folder = Path(folder)
    save_model(random_model(TINY_CONFIG, seed=seed, std=0.1), folder)
    save_tokenizer(byte_level_tokenizer(), folder)
    return folder


def _bundled(name: str) -> Path:
    folder = BUNDLED / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled default model is missing ({folder}): this installation of speculum is "
            "incomplete; reinstall it, or pass --model DIR"
        )
    return folder


def default_model_dir() -> Path:
    """Folder of the bundled default target (a Hugging Face Llama folder)."""
    return _bundled("target")


def default_draft_dir() -> Path:
    """Folder of the bundled default target's EAGLE-3 draft."""
    return _bundled("eagle3")
