"""Frozen state records: the values that flow between speculum's pure stages.

A record is an attrs class that is frozen, slotted, keyword-only and compared by identity
(tensor ``==`` is elementwise, so ``eq`` would lie). It is registered as a torch pytree: data
fields are children, static fields (Python values that decide shapes or code paths) live in the
treespec, so changing one recompiles on purpose.

Records are built with their checked ``__init__`` at eager boundaries and with :func:`replace`
inside compiled stages (dynamo cannot trace attrs' generated ``__init__``, but it can trace
``object.__new__`` plus ``object.__setattr__``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.utils._pytree as pytree

__all__ = [
    "record",
    "static",
    "make",
    "replace",
    "tree_equal",
    "snapshot",
    "fields_of",
    "leaves_and_structure",
    "rebuilder",
    "tree_map_tensors",
    "TYPECHECK_ENV",
]

T = TypeVar("T")

#: Environment variable that switches on jaxtyping + beartype checking of record constructors.
#: The test suite sets it; benchmarks leave it unset (a checked construction costs ~50 us).
TYPECHECK_ENV = "SPECULUM_TYPECHECK"

_STATIC = "speculum_static"
#: Each record class's (data, static) field names, for :func:`leaves_and_structure`.
_LAYOUTS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def static(**kwargs: Any) -> Any:
    """Declare a static record field: a Python value kept in the pytree treespec.

    Static fields decide shapes or code paths (``topk``, ``page_size``, a dtype); two records
    that differ only in a static field have different treespecs, so compiled code specialises.
    """
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


def fields_of(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the (data, static) fields of a record class, in declaration order."""
    data, stat = [], []
    for f in attrs.fields(cls):
        (stat if f.metadata.get(_STATIC) else data).append(f.name)
    return tuple(data), tuple(stat)


def _typecheck_enabled() -> bool:
    return os.environ.get(TYPECHECK_ENV, "") not in ("", "0", "false", "False")


def record(cls: type[T]) -> type[T]:
    """Turn a class with annotated fields into a frozen, pytree-registered state record.

    Field annotations may use jaxtyping (``Int[Tensor, "batch num_draft"]``); when the
    ``SPECULUM_TYPECHECK`` environment variable is set at class-definition time, ``__init__``
    checks dtypes, ranks and cross-field axis sizes with beartype.
    """
    cls = attrs.define(frozen=True, slots=True, kw_only=True, eq=False, repr=True)(cls)
    data_names, static_names = fields_of(cls)
    _LAYOUTS[cls] = data_names, static_names

    def flatten(rec: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children = [getattr(rec, n) for n in data_names]
        context = tuple(getattr(rec, n) for n in static_names)
        return children, context

    def unflatten(children: Any, context: tuple[Any, ...]) -> Any:
        return _build(cls, dict(zip(data_names, children)) | dict(zip(static_names, context)))

    def flatten_with_keys(rec: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, context = flatten(rec)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(data_names, children)], context

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    if _typecheck_enabled():
        from beartype import beartype
        from jaxtyping import jaxtyped

        cls.__init__ = jaxtyped(cls.__init__, typechecker=beartype)  # type: ignore[method-assign]
    return cls


def _build(cls: type[T], values: dict[str, Any]) -> T:
    # object.__new__ + object.__setattr__ is the construction dynamo can trace; the instance is
    # still frozen afterwards because attrs' __setattr__ is what raises, not the slots.
    rec = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(rec, name, value)
    return rec


def make(cls: type[T], **values: Any) -> T:
    """Construct record ``cls`` from its fields (those with defaults may be left out); safe
    inside ``torch.compile``.

    Eagerly this is the checked ``cls(**values)`` (type-checked under pytest); while compiling
    it builds the instance field by field, which dynamo can trace, defaults included.
    """
    if torch.compiler.is_compiling():
        return _build(cls, {**_defaults(cls, values), **values})
    return cls(**values)


def _defaults(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The default values of the fields of ``cls`` not in ``given`` (plain defaults and
    ``attrs.Factory`` ones; a field with neither is left to fail as a missing attribute)."""
    defaults = {}
    for f in attrs.fields(cls):
        if f.name not in given and f.default is not attrs.NOTHING:
            default = f.default
            defaults[f.name] = default.factory() if isinstance(default, attrs.Factory) else default
    return defaults


def replace(rec: T, **changes: Any) -> T:
    """Return a copy of ``rec`` with ``changes`` applied; safe inside ``torch.compile``.

    Unlike ``attrs.evolve`` it runs no validation: use ``attrs.evolve`` at eager boundaries
    where a checked construction is wanted.
    """
    cls = type(rec)
    names = [f.name for f in attrs.fields(cls)]
    unknown = set(changes) - set(names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}; fields are {names}")
    return _build(cls, {n: changes[n] if n in changes else getattr(rec, n) for n in names})


class _OtherNode(Exception):
    """A node :func:`leaves_and_structure` leaves to pytree (a dict, a named tuple...)."""


#: Marks a leaf's place in a walked tree's structure.
_LEAF = object()


def leaves_and_structure(tree: Any) -> tuple[list[Any], Any]:
    """``tree``'s leaves in ``pytree.tree_flatten``'s order, and a value standing for its
    treespec: two trees' structures are equal exactly when their treespecs are.

    Records, tuples and lists, what the decoding state is made of, are walked directly: a
    graph-replayed round flattens its state on every call, and pytree's generic walk (a
    registry lookup and named-tuple checks per node, a ``TreeSpec`` built per node) was most
    of that host work. The structure is then the walk's tuple of node markers (a record's class
    with its static fields, a container's type and length, one mark per leaf). A tree with any
    other node (a dict, a named tuple, another registered type) is flattened by pytree, and its
    treespec is the structure.
    """
    leaves: list[Any] = []
    marks: list[Any] = []
    try:
        _walk(tree, leaves, marks)
    except _OtherNode:
        return pytree.tree_flatten(tree)
    return leaves, tuple(marks)


def _walk(node: Any, leaves: list[Any], marks: list[Any]) -> None:
    cls = type(node)
    layout = _LAYOUTS.get(cls)
    if layout is not None:
        data_names, static_names = layout
        marks.append((cls, tuple(getattr(node, n) for n in static_names)))
        for name in data_names:
            _walk(getattr(node, name), leaves, marks)
    elif cls is tuple or cls is list:
        marks.append((cls, len(node)))
        for child in node:
            _walk(child, leaves, marks)
    elif _left_to_pytree(node):
        raise _OtherNode
    else:
        leaves.append(node)
        marks.append(_LEAF)


def _left_to_pytree(node: Any) -> bool:
    """Whether ``node``, neither a record nor a plain tuple or list, is a node pytree flattens
    (a dict, a named tuple, another registered type) rather than a leaf: the walks of
    :func:`leaves_and_structure` and :func:`rebuilder` leave it to pytree."""
    return isinstance(node, (tuple, list, dict)) or type(node) in pytree.SUPPORTED_NODES


def rebuilder(example: Any) -> Callable[[Sequence[Any]], Any]:
    """A function rebuilding trees shaped like ``example`` from their leaves, in pytree's
    order: the same tree ``pytree.tree_unflatten(leaves, spec)`` gives for ``example``'s
    treespec, faster when called many times (a graph-replayed round rebuilds its output records
    on every call). Records are built field by field as :func:`replace` builds them, without
    validation; tuples and lists directly; any other node by pytree.
    """
    build = _node_builder(example)
    return lambda leaves: build(iter(leaves))


def _node_builder(node: Any) -> Callable[[Iterator[Any]], Any]:
    cls = type(node)
    layout = _LAYOUTS.get(cls)
    if layout is not None:
        data_names, static_names = layout
        children = [(name, _node_builder(getattr(node, name))) for name in data_names]
        statics = [(name, getattr(node, name)) for name in static_names]

        def build_record(leaves: Iterator[Any]) -> Any:
            rec = object.__new__(cls)
            for name, child in children:
                object.__setattr__(rec, name, child(leaves))
            for name, value in statics:
                object.__setattr__(rec, name, value)
            return rec

        return build_record
    if cls is tuple or cls is list:
        items = [_node_builder(child) for child in node]
        return lambda leaves: cls(item(leaves) for item in items)
    if _left_to_pytree(node):
        count = len(pytree.tree_leaves(node))
        spec = pytree.tree_structure(node)
        return lambda leaves: pytree.tree_unflatten([next(leaves) for _ in range(count)], spec)
    return next


def _leaf_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    return bool(a == b)


def tree_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees of records have the same structure, static fields and leaf values.

    Tensors are equal when dtype, shape, device and every element agree (NaN != NaN).
    """
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    return spec_a == spec_b and all(_leaf_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], tree: T) -> T:
    """Apply ``fn`` to every tensor leaf of ``tree``, leaving other leaves as they are."""
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def snapshot(tree: T) -> T:
    """A copy of ``tree`` whose tensors are cloned, so later in-place writes cannot reach it.

    Records are immutable, but CUDA-graph outputs are buffers overwritten by the next replay:
    anything kept across steps goes through ``snapshot``.
    """
    return tree_map_tensors(torch.clone, tree)
