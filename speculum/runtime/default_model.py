"""The bundled default model: until trained weights ship, a tiny random Llama written on first use.

Its completions are gibberish by construction; it exists so that ``speculum generate`` runs on
a fresh machine with no download and so that every code path has a real checkpoint to load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from speculum.models.config import DecoderConfig
from speculum.models.loading import random_model, save_model
from speculum.models.tokenizer import byte_level_tokenizer, save_tokenizer

__all__ = ["TINY_CONFIG", "default_model_dir", "write_tiny_model"]

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


def default_model_dir() -> Path:
    """Folder of the default model, written on first use under ``$SPECULUM_CACHE``
    (default ``~/.cache/speculum``)."""
    cache = Path(os.environ.get("SPECULUM_CACHE", Path.home() / ".cache" / "speculum"))
    folder = cache / "tiny-random-llama"
    if not (folder / "model.safetensors").exists():
        # Write into a temporary sibling and rename, so an interrupted first run never leaves
        # a half-written folder that looks like a model.
        staging = cache / f".tiny-random-llama.{os.getpid()}"
        write_tiny_model(staging)
        if folder.exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            staging.replace(folder)
    return folder
