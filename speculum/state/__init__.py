"""Frozen state records, pytree registration, and compile-safe record updates."""

from speculum.state.batch import batch_size, concat_rows, take_rows
from speculum.state.forward import ForwardBatch
from speculum.state.kv import KVPool, KVPoolExhausted, PageAllocator, PagedKV
from speculum.state.record import (
    TYPECHECK_ENV,
    fields_of,
    make,
    record,
    replace,
    snapshot,
    static,
    tree_equal,
    tree_map_tensors,
)
from speculum.state.sampling import Penalties, SamplingParams, TokenLogprobs
from speculum.state.tree import AcceptResult, DraftCandidates, DraftTree

__all__ = [
    "AcceptResult",
    "DraftCandidates",
    "DraftTree",
    "ForwardBatch",
    "TYPECHECK_ENV",
    "KVPool",
    "KVPoolExhausted",
    "PageAllocator",
    "PagedKV",
    "Penalties",
    "SamplingParams",
    "TokenLogprobs",
    "batch_size",
    "concat_rows",
    "fields_of",
    "make",
    "record",
    "replace",
    "snapshot",
    "static",
    "take_rows",
    "tree_equal",
    "tree_map_tensors",
]
