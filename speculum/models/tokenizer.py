"""Text in and out of token ids: a thin wrapper over a Hugging Face ``tokenizer.json``.

Encoding follows what transformers' ``AutoTokenizer`` does by default (``add_special_tokens=True``):
whatever the tokenizer's own post-processor adds (Llama's BOS, nothing for GPT-2-style
tokenizers) is added here too, so prompts reach the model exactly as they would under
transformers. Decoding drops special tokens, as a chat front end shows text.

:func:`byte_level_tokenizer` builds, without any training data, a tokenizer whose tokens are the
256 bytes, so a tiny default model can ship with a real tokenizer that covers every UTF-8 string.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

import attrs
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from speculum.models.loading import CheckpointError

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "byte_level_tokenizer",
    "save_tokenizer",
    "TOKENIZER_FILE",
    "BOS",
    "EOS",
]

#: The one file a checkpoint folder's tokenizer is read from.
TOKENIZER_FILE = "tokenizer.json"
#: Special tokens of :func:`byte_level_tokenizer`, ids 256 and 257.
BOS, EOS = "<s>", "</s>"


@attrs.define(frozen=True, slots=True)
class Tokenizer:
    """Encode text to ids and decode ids to text with a ``tokenizers.Tokenizer``."""

    inner: tokenizers.Tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the post-processor adds (e.g. BOS)
        unless ``add_special_tokens`` is False (a rendered chat template writes its own).

        As under transformers, the text of a special token inside ``text`` (``"<s>"``) is read
        as that special token.
        """
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (ints or 0-d tensors), special tokens left out."""
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's log-probability ``bytes``): exact for
        byte-level BPE tokenizers (GPT-2, Llama 3, Qwen: a token that is part of a multi-byte
        character gives those bytes, where its decoded text is U+FFFD) and for byte-fallback
        tokens such as ``<0x0A>``; otherwise the UTF-8 of its text. Special tokens, whose text
        decoding drops, give none."""
        text = self.decode([token_id])
        piece = self.inner.id_to_token(int(token_id))
        if not text or piece is None:
            return b""
        names = _byte_values()
        if isinstance(self.inner.decoder, decoders.ByteLevel) and all(c in names for c in piece):
            return bytes(names[c] for c in piece)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(fallback.group(1), 16)]) if fallback else text.encode()

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.inner.get_vocab_size(with_added_tokens=True)


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder, read from its ``tokenizer.json``.

    Raises :class:`CheckpointError` naming the file when it is missing or unreadable (only the
    fast-tokenizer format is read: no ``tokenizer.model`` / sentencepiece).
    """
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"no tokenizer: {path} does not exist; save the tokenizer with the model "
            "(transformers: tokenizer.save_pretrained(folder)) or pass --prompt-ids instead"
        )
    try:
        inner = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(
            f"cannot read tokenizer {path}: {err}; pass --prompt-ids instead"
        ) from err
    return Tokenizer(inner)


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer: ids 0-255 are the bytes, 256 is ``<s>``, 257 is ``</s>``.

    No merges, so every UTF-8 string encodes to its bytes (after a leading ``<s>``, which the
    post-processor adds as a Llama tokenizer does) and decodes back to itself, provided it does
    not contain the text of a special token.
    """
    vocab = {name: byte for byte, name in enumerate(_byte_names())}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space (it would not round-trip) and no regex split (without merges it changes
    # nothing but speed).
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([BOS, EOS])
    inner.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, inner.token_to_id(BOS))]
    )
    return inner


def _byte_names() -> list[str]:
    # GPT-2's bytes_to_unicode table, which the ByteLevel pre-tokenizer and decoder apply: each
    # printable Latin-1 byte is named by its own character, the other 68 bytes by 256, 257, ...
    # in increasing order.
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


@functools.cache
def _byte_values() -> dict[str, int]:
    """The byte each character of a byte-level token stands for (:func:`_byte_names` inverted)."""
    return {name: byte for byte, name in enumerate(_byte_names())}


def save_tokenizer(tokenizer: tokenizers.Tokenizer, folder: str | Path) -> Path:
    """Write ``tokenizer`` to ``folder/tokenizer.json`` (creating ``folder``); return the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path
