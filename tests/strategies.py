"""Hypothesis strategies shared by the greedy-equality properties of every pipeline."""

from __future__ import annotations

from hypothesis import strategies as st

#: Page sizes of 1 and of several tokens (trees and draft tails then cross page boundaries).
page_sizes = st.sampled_from([1, 4])
#: A prefill budget that chunks most prompts, and one that never does.
prefill_budgets = st.sampled_from([5, 64])
max_new_tokens = st.integers(1, 12)


def prompt_batches(vocab: int, max_batch: int = 8) -> st.SearchStrategy[list[list[int]]]:
    """Batches of 1 to ``max_batch`` prompts of 1 to 12 token ids."""
    prompt = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    return st.lists(prompt, min_size=1, max_size=max_batch)


def stop_token_sets(vocab: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Up to two stop token ids (they often fire in the middle of a speculative round)."""
    return st.sets(st.integers(0, vocab - 1), max_size=2).map(tuple)


def shared_prefix_batches(vocab: int, max_batch: int = 5) -> st.SearchStrategy[list[list[int]]]:
    """Batches of 1 to ``max_batch`` prompts, each one of two shared prefixes of up to 14 token
    ids followed by up to 5 of its own (at least one token in all): prefix caching hits."""
    tokens = st.lists(st.integers(0, vocab - 1), max_size=14)
    own = st.lists(st.integers(0, vocab - 1), max_size=5)

    def batches(prefixes: list[list[int]]) -> st.SearchStrategy[list[list[int]]]:
        prompt = st.tuples(st.sampled_from(prefixes), own).map(lambda p: p[0] + p[1])
        return st.lists(prompt.filter(len), min_size=1, max_size=max_batch)

    return st.lists(tokens, min_size=1, max_size=2).flatmap(batches)


@st.composite
def parent_lists(draw: st.DrawFn, max_nodes: int = 7) -> list[int]:
    """A draft tree's parents in level order: node 0 the root (-1), every other node's parent
    earlier."""
    size = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
