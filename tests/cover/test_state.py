"""Records: frozen values, pytrees with static fields, checked constructors, compile safety."""

from __future__ import annotations

import collections

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import tiny_config
from hypothesis import example, given
from hypothesis import strategies as st
from jaxtyping import Float, Int
from torch import Tensor

from speculum.models.loading import random_model
from speculum.pipelines import plain
from speculum.pipelines.base import Resources, StepOutput
from speculum.state import (
    PagedKV,
    SamplingParams,
    concat_rows,
    make,
    record,
    replace,
    snapshot,
    static,
    take_rows,
    tree_equal,
)
from speculum.state.kv import KVPoolExhausted, allocate, allocated_pages, free, new_allocator
from speculum.state.record import leaves_and_structure, rebuilder


@record
class Pair:
    """A test record with a data pair and a static width."""

    a: Float[Tensor, "batch width"]
    b: Int[Tensor, " batch"]
    width: int = static()


def pair(batch: int = 3, width: int = 2, offset: int = 0) -> Pair:
    return Pair(
        a=torch.arange(batch * width, dtype=torch.float32).reshape(batch, width) + offset,
        b=torch.arange(batch, dtype=torch.int64),
        width=width,
    )


def test_records_are_frozen_and_keyword_only():
    rec = pair()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        rec.a = torch.zeros(3, 2)
    with pytest.raises(TypeError):
        Pair(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 2)


def test_replace_returns_a_new_record_and_leaves_the_old_one():
    rec = pair()
    new = replace(rec, b=rec.b + 1)
    assert torch.equal(rec.b, torch.arange(3)) and torch.equal(new.b, torch.arange(1, 4))
    assert new.a is rec.a and new.width == 2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        new.b = rec.b
    with pytest.raises(TypeError, match="no field"):
        replace(rec, c=1)


def test_static_fields_live_in_the_treespec():
    leaves, spec = pytree.tree_flatten(pair(width=2))
    assert len(leaves) == 2  # a and b; width is static
    _, other = pytree.tree_flatten(pair(width=3))
    assert spec != other
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, Pair) and tree_equal(rebuilt, pair(width=2))


@record
class Node:
    """A test record holding any two subtrees, with a static tag."""

    left: object
    right: object
    tag: int = static()


Point = collections.namedtuple("Point", "x y")

_leaves = st.one_of(
    st.none(), st.integers(0, 2), st.integers(1, 3).map(lambda n: torch.zeros(n, 2))
)
_trees = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.tuples(children, children),
        st.lists(children, max_size=3),
        st.builds(
            lambda a, b, tag: Node(left=a, right=b, tag=tag), children, children, st.integers(0, 1)
        ),
        st.dictionaries(st.sampled_from("ab"), children, max_size=2),
        st.builds(Point, children, children),
    ),
    max_leaves=8,
)


def _retagged(tree, tag: int):
    """``tree`` with its first record's tag set to ``tag`` (the same tree if it has none)."""
    if isinstance(tree, Node):
        return replace(tree, tag=tag)
    if type(tree) in (tuple, list):
        return type(tree)(_retagged(child, tag) for child in tree)
    if isinstance(tree, Point):
        return Point(*(_retagged(child, tag) for child in tree))
    if isinstance(tree, dict):
        return {key: _retagged(child, tag) for key, child in tree.items()}
    return tree


@given(first=_trees, other=_trees, how=st.sampled_from(["same", "retag", "other"]))
@example(first=(0, (0,)), other=((0,), 0), how="other")  # one leaf and one tuple, placed apart
def test_the_fast_flatten_gives_pytrees_leaves_and_structures_equal_as_treespecs(first, other, how):
    """``leaves_and_structure`` (what a graph-replayed round flattens its state with) gives
    pytree's leaves, the same objects in the same order, and structures equal exactly when the
    treespecs are: for the same tree rebuilt, a record's static field changed, another tree."""
    second = {"same": pytree.tree_map(lambda x: x, first), "retag": _retagged(first, 2)}.get(
        how, other
    )
    for tree in (first, second):
        leaves, _ = leaves_and_structure(tree)
        expected, _ = pytree.tree_flatten(tree)
        assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    same_spec = pytree.tree_flatten(first)[1] == pytree.tree_flatten(second)[1]
    assert (leaves_and_structure(first)[1] == leaves_and_structure(second)[1]) == same_spec


@given(tree=_trees)
def test_a_rebuilder_rebuilds_what_pytree_unflattens(tree):
    """``rebuilder`` (what a graph-replayed round rebuilds its output records with) gives, over
    other leaves, the tree ``pytree.tree_unflatten`` gives: the same treespec, the same leaf
    objects in place, records of the same classes with the same static fields."""
    leaves, spec = pytree.tree_flatten(tree)
    others = [object() for _ in leaves]
    rebuilt = rebuilder(tree)(others)
    expected = pytree.tree_unflatten(others, spec)
    got_leaves, got_spec = pytree.tree_flatten(rebuilt)
    assert got_spec == spec == pytree.tree_structure(expected)
    assert all(a is b for a, b in zip(got_leaves, others, strict=True))


@given(st.integers(1, 4), st.integers(1, 3), st.integers(-2, 2))
def test_tree_equal_compares_values_dtypes_and_statics(batch, width, offset):
    base = pair(batch, width)
    assert tree_equal(base, pair(batch, width))
    assert tree_equal(base, pair(batch, width, offset)) == (offset == 0)
    assert not tree_equal(base, replace(base, b=base.b.to(torch.int32)))
    assert not tree_equal(base, replace(base, width=width + 1))


def test_snapshot_is_unaffected_by_later_in_place_writes():
    rec = pair()
    kept = snapshot(rec)
    rec.a.add_(100.0)  # what a CUDA-graph replay does to its output buffers
    assert tree_equal(kept, pair())


def test_checked_constructor_rejects_wrong_dtype_and_inconsistent_axes():
    with pytest.raises(Exception, match="page_table|Int"):
        PagedKV(
            page_table=torch.zeros(2, 3), seq_lens=torch.zeros(2, dtype=torch.int64), page_size=4
        )
    with pytest.raises(Exception, match="batch|seq_lens"):
        PagedKV(
            page_table=torch.zeros(2, 3, dtype=torch.int64),
            seq_lens=torch.zeros(5, dtype=torch.int64),
            page_size=4,
        )


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_take_and_concat_rows_are_inverse(sizes, data):
    parts = [pair(n, 2, offset=10 * i) for i, n in enumerate(sizes)]
    whole = concat_rows(parts)
    start = 0
    for part in parts:
        rows = torch.arange(start, start + part.b.shape[0])
        assert tree_equal(take_rows(whole, rows), part)
        start += part.b.shape[0]
    order = torch.tensor(data.draw(st.permutations(range(start))), dtype=torch.int64)
    shuffled = take_rows(whole, order)
    assert tree_equal(take_rows(shuffled, torch.argsort(order)), whole)


def test_make_builds_inside_compiled_code():
    @torch.compile(fullgraph=True, backend="eager")
    def shift(rec: Pair) -> Pair:
        return make(Pair, a=rec.a * 2, b=rec.b + 1, width=rec.width)

    out = shift(pair())
    assert isinstance(out, Pair) and tree_equal(
        out, Pair(a=pair().a * 2, b=torch.arange(1, 4), width=2)
    )


def test_make_fills_defaults_inside_compiled_code_as_eagerly():
    """A field with a default may be left out of ``make`` in compiled code too (dynamo's
    field-by-field construction once left it unset: an AttributeError on first use)."""

    @torch.compile(fullgraph=True, backend="eager")
    def output(tokens: torch.Tensor) -> StepOutput:
        return make(StepOutput, tokens=tokens, num_tokens=tokens[:, 0], faults=tokens[:, 1])

    tokens = torch.arange(6).view(3, 2)
    eager = make(StepOutput, tokens=tokens, num_tokens=tokens[:, 0], faults=tokens[:, 1])
    compiled = output(tokens)
    assert compiled.plain_steps is False and tree_equal(compiled, eager)


def test_plain_decode_stage_compiles_fullgraph_and_matches_eager():
    """A whole stage over records (model forward, KV write, sampling, record updates) traces
    into one graph and computes exactly what the eager stage computes."""
    model = random_model(tiny_config(), seed=1, std=0.2)
    alloc = new_allocator(16)
    alloc, pages = allocate(alloc, 4)
    state = plain.PlainState(
        kv=PagedKV(
            page_table=torch.stack([pages[:2], pages[2:]]),
            seq_lens=torch.tensor([3, 5]),
            page_size=4,
        ),
        next_tokens=torch.tensor([7, 9]),
        sampling=SamplingParams(
            temperature=torch.tensor([0.0, 0.9]),
            top_k=torch.tensor([0, 10]),
            top_p=torch.tensor([1.0, 0.9]),
            min_p=torch.tensor([0.0, 0.05]),
            seed=torch.tensor([1, 2]),
        ),
    )
    eager_pool = model.new_pool(16, 4)
    compiled_pool = model.new_pool(16, 4)
    eager = plain.decode(Resources(target=model, target_pool=eager_pool), state)
    compiled_decode = torch.compile(plain.decode, fullgraph=True, backend="aot_eager")
    compiled = compiled_decode(Resources(target=model, target_pool=compiled_pool), state)
    assert tree_equal(eager, compiled)
    assert torch.equal(eager_pool.k, compiled_pool.k) and torch.equal(eager_pool.v, compiled_pool.v)


@given(
    num_pages=st.integers(2, 12),
    held=st.sets(st.integers(1, 11), max_size=3),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("allocate"), st.integers(0, 5)),
            st.tuples(st.just("free"), st.lists(st.integers(-1, 13), max_size=4)),
        ),
        max_size=12,
    ),
)
def test_the_page_allocator_is_a_set_of_free_pages(num_pages, held, ops):
    """Allocation and freeing behave as a set of free page ids (page 0, the padding sink, and
    pages a prefix cache holds never free): pages handed out are distinct and were free;
    freeing a page that is free, out of range, or named twice is refused, with the allocator
    handed in unchanged, as is allocating more pages than are free."""
    held = {p for p in held if p < num_pages}
    alloc = new_allocator(num_pages, held)
    free_set = set(range(1, num_pages)) - held
    for op, arg in ops:
        if op == "allocate":
            if arg > len(free_set):
                with pytest.raises(KVPoolExhausted):
                    allocate(alloc, arg)
                continue
            alloc, pages = allocate(alloc, arg)
            taken = pages.tolist()
            assert len(set(taken)) == len(taken) and set(taken) <= free_set
            free_set -= set(taken)
        elif set(arg) <= set(range(1, num_pages)) - free_set and len(set(arg)) == len(arg):
            alloc = free(alloc, torch.tensor(arg, dtype=torch.int64))
            free_set |= set(arg)
        else:
            with pytest.raises(ValueError, match="double free or invalid page ids"):
                free(alloc, torch.tensor(arg, dtype=torch.int64))
        assert allocated_pages(alloc) == set(range(1, num_pages)) - free_set
        assert set(alloc.free_pages[: int(alloc.num_free)].tolist()) == free_set
