"""Target models (the Llama/Qwen2/Qwen3/Mistral family), Hugging Face checkpoint I/O, tokenizer."""

from speculum.models.config import (
    ROPE_TYPES,
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    UnsupportedModel,
)
from speculum.models.decoder import DecoderModel
from speculum.models.loading import (
    CheckpointError,
    load_model,
    load_state_dict,
    random_model,
    save_model,
)
from speculum.models.tokenizer import (
    Tokenizer,
    byte_level_tokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "DecoderConfig",
    "DecoderModel",
    "Tokenizer",
    "UnsupportedModel",
    "byte_level_tokenizer",
    "load_model",
    "load_state_dict",
    "load_tokenizer",
    "random_model",
    "save_model",
    "save_tokenizer",
]
