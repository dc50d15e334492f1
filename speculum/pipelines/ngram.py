"""NGRAM: model-free drafting from n-gram matches (SGLang's NGRAM), verified as a tree.

One round:

1. ``draft`` (host): the request's last tokens are matched against its own history, the shared
   n-gram store and an optional corpus, and the continuations become a draft tree of
   ``num_draft_tokens`` nodes (``speculum.spec.ngram.match``; ragged trees are padded with
   nodes acceptance can never reach).
2. ``verify``: one target forward over the tree under the tree mask, then acceptance with
   ``draft_probs=None``: n-gram drafts are chosen deterministically, so the verifier's draft
   distribution is the one-hot of each node's token (``spec.verify.verify_tree``).
3. ``commit``: the accepted path's K/V moves to consecutive cache slots
   (``spec.verify.commit_path``); the bonus token becomes the next root.
4. ``record``: the emitted tokens are appended to the history (one device-to-host copy), and
   the history's new stretches are inserted into the shared store (``store_accepted``).

Steps 2 and 3 are the round's device part, :func:`verified_round`: a pure function of the cache,
the sampling state and the drafted trees (:class:`NgramRound`, every leaf on the device), which
``decode`` takes as its ``device_round`` keyword. On CUDA the engine passes a captured version
(``Pipeline.device_round``, ``runtime.graphs.GraphedDecode``), so only the matcher and the
history bookkeeping run from Python: the target's forward, acceptance and the commit replay as
one graph per batch bucket.

The batch state carries each request's history as a fixed-width host tensor (every tensor leaf
leads with the batch axis, so the scheduler moves rows generically). The store is not batch
state: it is shared by every request and lives in ``Resources.ngram_store``, a cell holding an
immutable :class:`~speculum.spec.ngram.NgramStore`; a round reads the cell's value and puts a
new value back. A scheduler snapshot keeps the value, so restoring it replays bit-exactly.

Store insertion. A request's history reaches the store in stretches of at least
``flush_tokens`` new tokens. Each stretch is inserted with the ``max_depth - 1`` tokens before
it as leading context (so matches of every length can end on its first token) and with its
last ``tree depth`` tokens as trailing context, to be inserted as occurrences with the next
stretch: then every occurrence in the store has a full-depth continuation inside its stream,
and each history position is an occurrence exactly once. The last ``< flush_tokens + depth``
tokens of a finished request never become occurrences. A request's own inserted tokens are
seen twice by its later rounds (history and store); recency order is unaffected, frequency
counts them twice.

Device matcher (``matcher="device"``, :func:`device_decode`). The history lives on the device
instead (same fields, every leaf on the cache's device), the matcher is
``speculum.spec.ngram_device.match_chain`` (one chain per request, from the history alone: no
store, no corpus) and the accepted tokens are appended on the device, so the whole round
(match, verify, accept, commit, append) is one pure device function: the engine captures it
as it captures every other pipeline's round (``host_work=False``), and the overlap scheduler
launches round ``t + 1`` before reading round ``t``'s tokens. Under a grammar the round asks
``sampling.grammar`` for the masks at the chain's nodes, like an EAGLE round (graphs cut at
the ask): the chain is not pruned at refused tokens, which the masked target rejects.

Batch invariance. Greedy output equals plain decoding whatever the drafts. Sampled output is
exactly target-distributed, but which tokens a seed yields depends on the tree, hence on the
shared store, hence on what other requests inserted; set ``store_tokens=0`` (no store) for
outputs that depend on the request alone.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from jaxtyping import Int
from torch import Tensor

from speculum.pipelines import plain
from speculum.pipelines.base import (
    Pipeline,
    PrefillChunk,
    Resources,
    StepOutput,
    verified_output,
)
from speculum.spec.checks import checking, raise_for_rows
from speculum.spec.ngram import (
    CorpusIndex,
    NgramConfig,
    NgramDraft,
    NgramStore,
    insert_many,
    match,
    tree_bounds,
    validate_ngram_config,
)
from speculum.spec.ngram_device import append_tokens, match_chain
from speculum.spec.tree import tree_mask, tree_path_tokens
from speculum.spec.verify import commit_path, verify_tree
from speculum.state.host import to_device
from speculum.state.kv import PagedKV
from speculum.state.record import make, record, replace, static, tree_map_tensors
from speculum.state.sampling import SamplingParams
from speculum.state.tree import DraftTree, Verified

__all__ = [
    "NgramState",
    "NgramPipelineConfig",
    "NgramRound",
    "MATCHERS",
    "prefill",
    "device_prefill",
    "draft",
    "verify",
    "verified_round",
    "store_accepted",
    "decode",
    "device_decode",
    "HOST_ONLY",
    "validate_matcher",
    "pipeline",
]

#: Where a round's matcher runs: ``"host"`` (trees from the history, the store and the corpus,
#: built in Python before the round) or ``"device"`` (one chain from the history, inside the
#: round: ``speculum.spec.ngram_device``).
MATCHERS = ("host", "device")


@record
class NgramPipelineConfig:
    """The matcher's configuration, the tree bounds it implies, the store cadence, and
    whether the matcher runs on the device (:data:`MATCHERS`)."""

    matcher: NgramConfig = static()
    tree_depth: int = static()
    max_children: int = static()
    flush_tokens: int = static()
    on_device: bool = static(default=False)


@record
class NgramState:
    """Batch state between rounds.

    ``kv.seq_lens`` counts the tokens whose K/V are in the target cache; ``root_tokens`` is the
    last verified token (emitted, not yet in the cache). ``history[b, :history_len[b]]`` are the
    request's known tokens, prompt first, ending with the root (-1 beyond): host tensors for
    the host matcher, on the cache's device for the device matcher, whose capacity (the
    width the page table addresses) keeps every shape static.
    ``history[b, :stored_len[b]]`` are already occurrences in the shared store (the device
    matcher has none: 0).
    """

    kv: PagedKV
    root_tokens: Int[Tensor, " batch"]
    sampling: SamplingParams
    history: Int[Tensor, "batch context"]
    history_len: Int[Tensor, " batch"]
    stored_len: Int[Tensor, " batch"]


def prefill(
    resources: Resources, chunk: PrefillChunk, *, config: NgramPipelineConfig
) -> tuple[NgramState, StepOutput]:
    """Target prefill (as plain decoding), and each row's history: the prompt tokens before the
    chunk (``chunk.prefix_tokens``, when the caller supplies them), the chunk, and the first
    sampled token. The history is as wide as the page table can address; it is built on the
    cache's device (:func:`device_prefill`) and brought to the host in one copy."""
    state, first = device_prefill(resources, chunk, config=config)
    packed = torch.cat([state.history_len[:, None], state.history], dim=1).cpu()  # one copy
    host = replace(
        state,
        history=packed[:, 1:],
        history_len=packed[:, 0],
        stored_len=torch.zeros_like(packed[:, 0]),
    )
    return host, first


def device_prefill(
    resources: Resources, chunk: PrefillChunk, *, config: NgramPipelineConfig
) -> tuple[NgramState, StepOutput]:
    """:func:`prefill` for the device matcher: the same history, left on the cache's device
    (the host's ``prefix_tokens`` copied there without waiting for queued work). Checking that
    ``prefix_tokens`` holds every prompt token already cached costs one host sync, eagerly
    (``spec.checks``), as the prefill's own input checks do. Without ``prefix_tokens`` the
    history starts at the chunk."""
    base, first = plain.prefill(resources, chunk)
    device = chunk.tokens.device
    batch = chunk.tokens.shape[0]
    width = chunk.kv.page_table.shape[1] * chunk.kv.page_size
    seq_lens, q_lens = chunk.kv.seq_lens, chunk.q_lens
    history = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    start = torch.zeros_like(seq_lens)
    if chunk.prefix_tokens is not None:
        prefix = to_device(chunk.prefix_tokens, device)[:, :width]
        if checking():
            cached = torch.arange(prefix.shape[1], device=device)[None, :] < seq_lens[:, None]
            missing = (seq_lens > prefix.shape[1]) | (cached & (prefix < 0)).any(dim=1)
            problem = "prefix_tokens does not hold every prompt token in the cache (pass them all)"
            raise_for_rows("ngram prefill", [problem], [missing])
        history, start = append_tokens(history, start, prefix, seq_lens)
    # The chunk, then the first sampled token at column q_lens[b].
    column = torch.arange(chunk.tokens.shape[1] + 1, device=device)[None, :]
    tokens = torch.cat([chunk.tokens, first.tokens], dim=1)
    tokens = torch.where(column < q_lens[:, None], tokens, first.tokens)
    history, history_len = append_tokens(history, start, tokens, q_lens + 1)
    state = make(
        NgramState,
        kv=base.kv,
        root_tokens=base.next_tokens,
        sampling=base.sampling,
        history=history,
        history_len=history_len,
        stored_len=torch.zeros_like(history_len),
    )
    return state, first


def draft(
    resources: Resources,
    state: NgramState,
    config: NgramPipelineConfig,
    corpus: CorpusIndex | None,
) -> tuple[NgramDraft, Int[Tensor, "batch num_nodes words"]]:
    """The round's draft trees, matched on the host, moved to the cache's device, and the
    grammar's packed masks at their nodes (:func:`tree_masks`).

    Under a grammar (``sampling.grammar``, a ``HostGrammar``) each continuation is pruned at
    its first token the grammar refuses (``spec.ngram.match``'s ``legal``): copied text is not
    drawn from a masked distribution, and a refused token has target probability 0, so
    verifying it would only spend a tree position."""
    cell = resources.ngram_store
    grammar = state.sampling.grammar
    drafted = match(
        state.history,
        state.history_len,
        config.matcher,
        store=None if cell is None else cell.value,
        corpus=corpus,
        legal=None if grammar is None else grammar.legal,
    )
    device = state.kv.seq_lens.device
    masks = tree_masks(grammar, drafted.tree, device)
    return tree_map_tensors(lambda x: x.to(device, non_blocking=True), drafted), masks


def tree_masks(
    grammar: Callable[[Tensor], Tensor] | None, tree: DraftTree, device: torch.device
) -> Int[Tensor, "batch num_nodes words"]:
    """The grammar's packed masks after each node's path of the host ``tree`` (``[batch,
    num_nodes, 0]``, no words, without a grammar): an n-gram tree is known on the host before
    the round, so its masks are computed with it and travel with the round as an input, and
    the verify needs no mask from the host in the middle of the round (on CUDA: one graph,
    not graphs cut at a mask request)."""
    if grammar is None:
        return torch.zeros((*tree.tokens.shape, 0), dtype=torch.int32, device=device)
    return grammar(tree_path_tokens(tree, tree_mask(tree)))


@record
class NgramRound:
    """The device part of a round's input: the target cache, the sampling state and the
    drafted trees (every leaf on the device, batch first, so a round can be padded to a
    CUDA-graph bucket and captured). ``masks`` are the grammar's packed masks at the tree's
    nodes (:func:`tree_masks`; no words without a grammar), and ``sampling`` then carries no
    grammar callback: the round asks the host nothing. The device matcher's rounds have no
    words and keep the callback, which the verify asks at the tree's nodes."""

    kv: PagedKV
    sampling: SamplingParams
    tree: DraftTree
    masks: Int[Tensor, "batch num_nodes words"]


def verify(resources: Resources, round_: NgramRound, config: NgramPipelineConfig) -> Verified:
    """One target forward over the tree, then acceptance with one-hot draft distributions."""
    return verify_tree(
        resources.target,
        resources.target_pool,
        round_.kv,
        round_.tree,
        round_.sampling,
        max_depth=config.tree_depth,
        max_children=config.max_children,
        grammar_masks=round_.masks if round_.masks.shape[-1] else None,
    )


def verified_round(
    resources: Resources, round_: NgramRound, *, config: NgramPipelineConfig
) -> tuple[PagedKV, Int[Tensor, " batch"], StepOutput]:
    """Verify, accept and commit: the committed cache, each row's bonus token (the next root)
    and what the round emits. No host work, so it can run as a CUDA graph."""
    verified = verify(resources, round_, config)
    acc = verified.accepted
    kv = commit_path(resources.target_pool, round_.kv, acc)
    bonus = acc.emitted.gather(1, acc.num_accepted[:, None])[:, 0]
    return kv, bonus, verified_output(verified)


def store_accepted(
    store: NgramStore,
    history: Int[Tensor, "batch context"],
    history_len: Int[Tensor, " batch"],
    stored_len: Int[Tensor, " batch"],
    config: NgramPipelineConfig,
) -> tuple[NgramStore, Int[Tensor, " batch"]]:
    """Insert every row's history stretch that has grown by ``flush_tokens`` occurrences
    (module docstring), in row order; returns the new store and the new ``stored_len``."""
    lead_room, trail = config.matcher.max_depth - 1, config.tree_depth
    ready = history_len - trail - stored_len >= config.flush_tokens
    streams, stored = [], stored_len.clone()
    for row in torch.nonzero(ready).flatten().tolist():
        done, end = int(stored_len[row]), int(history_len[row])
        start = max(0, done - lead_room)
        streams.append((history[row, start:end].numpy(), done - start, trail))
        stored[row] = end - trail
    return (insert_many(store, streams) if streams else store), stored


def decode(
    resources: Resources,
    state: NgramState,
    *,
    config: NgramPipelineConfig,
    corpus: CorpusIndex | None,
    device_round: Callable[[Resources, NgramRound], tuple[PagedKV, Tensor, StepOutput]],
) -> tuple[NgramState, StepOutput]:
    """One round: match (host), verify, accept, commit (``device_round``: :func:`verified_round`
    or a captured version of it), record the emitted tokens (host)."""
    drafted, masks = draft(resources, state, config, corpus)
    sampling = replace(state.sampling, grammar=None)  # its masks are in the round's input
    round_ = make(NgramRound, kv=state.kv, sampling=sampling, tree=drafted.tree, masks=masks)
    kv, bonus, output = device_round(resources, round_)
    # A faulty row emits fewer tokens than it accepted; it is finished with an error, so its
    # history no longer matters.
    packed = torch.cat([output.num_tokens[:, None], output.tokens], dim=1).cpu()  # one copy
    history, history_len = append_tokens(
        state.history, state.history_len, packed[:, 1:], packed[:, 0]
    )
    stored_len = state.stored_len
    cell = resources.ngram_store
    if cell is not None:
        cell.value, stored_len = store_accepted(
            cell.value, history, history_len, stored_len, config
        )
    new_state = replace(
        state,
        kv=kv,
        root_tokens=bonus,
        history=history,
        history_len=history_len,
        stored_len=stored_len,
    )
    return new_state, output


def device_decode(
    resources: Resources, state: NgramState, *, config: NgramPipelineConfig
) -> tuple[NgramState, StepOutput]:
    """One round of the device matcher, a pure device function (no host sync, static shapes):
    match each history's chain (``spec.ngram_device.match_chain``), verify, accept and commit
    (:func:`verified_round`), append the emitted tokens to the history. Under a grammar the
    verify asks ``sampling.grammar`` for the masks at the chain's nodes."""
    tree = match_chain(state.history, state.history_len, config.matcher).tree
    masks = torch.zeros((*tree.tokens.shape, 0), dtype=torch.int32, device=tree.tokens.device)
    round_ = make(NgramRound, kv=state.kv, sampling=state.sampling, tree=tree, masks=masks)
    kv, bonus, output = verified_round(resources, round_, config=config)
    history, history_len = append_tokens(
        state.history, state.history_len, output.tokens, output.num_tokens
    )
    new_state = replace(state, kv=kv, root_tokens=bonus, history=history, history_len=history_len)
    return new_state, output


#: Settings of the host matcher alone: the device matcher drafts one chain (breadth 1, the
#: most recent occurrence), so none of them applies to it away from :func:`pipeline`'s default.
HOST_ONLY = ("min_breadth", "max_breadth", "order", "max_occurrences", "flush_tokens")
#: The host-only settings that a chain has: passing these to the device matcher is harmless.
_CHAIN = {"min_breadth": 1, "max_breadth": 1}


def validate_matcher(matcher: str, *, corpus: object, store: bool, **settings: object) -> None:
    """Raise ``ValueError`` when ``matcher`` is not one of :data:`MATCHERS`, or when the
    device matcher is combined with what only the host matcher reads: a corpus, the shared
    store, or a :data:`HOST_ONLY` setting away from its default (breadth 1 is the chain's own,
    so also accepted)."""
    if matcher not in MATCHERS:
        raise ValueError(
            f"matcher={matcher!r} must be one of {', '.join(MATCHERS)} (where the n-gram "
            "matcher runs)"
        )
    if matcher == "host":
        return
    # Each setting at its default, or at the value the chain has (breadth 1), is harmless.
    defaults = {k: inspect.signature(pipeline).parameters[k].default for k in HOST_ONLY}
    problems = [
        f"{k}={v!r}"
        for k, v in settings.items()
        if k in HOST_ONLY and v not in (defaults[k], _CHAIN.get(k, defaults[k]))
    ]
    if corpus is not None:
        problems.append(f"corpus={corpus!r}")
    if store:
        problems.append("a shared store (store_tokens > 0)")
    if problems:
        raise ValueError(
            f"matcher='device' drafts one n-gram chain from each request's own history and "
            f"does not read {', '.join(problems)}: drop them (store_tokens=0, no corpus, "
            "breadth and order at their defaults) or use matcher='host'"
        )


def pipeline(
    *,
    num_draft_tokens: int = 8,
    max_depth: int = 18,
    min_match: int = 1,
    min_breadth: int = 1,
    max_breadth: int = 10,
    order: str = "recency",
    max_occurrences: int = 256,
    flush_tokens: int = 32,
    corpus: CorpusIndex | None = None,
    matcher: str = "host",
) -> Pipeline:
    """The NGRAM pipeline value (options in ``speculum.spec.ngram``; the store is a resource,
    ``Resources.ngram_store``, and the corpus a read-only index held by the value).
    ``matcher="device"`` drafts one chain per request on the device inside the round
    (:func:`device_decode`; no store, no corpus, no breadth or order settings:
    :func:`validate_matcher`)."""
    validate_matcher(
        matcher,
        corpus=corpus,
        store=False,
        min_breadth=min_breadth,
        max_breadth=max_breadth,
        order=order,
        max_occurrences=max_occurrences,
        flush_tokens=flush_tokens,
    )
    on_device = matcher == "device"
    if on_device:  # one chain: breadth 1 (tree_bounds then gives the fillers' fan-out)
        min_breadth = max_breadth = 1
    matcher_config = NgramConfig(
        num_draft_tokens=num_draft_tokens,
        max_depth=max_depth,
        min_match=min_match,
        min_breadth=min_breadth,
        max_breadth=max_breadth,
        order=order,
        max_occurrences=max_occurrences,
    )
    validate_ngram_config(matcher_config)
    if not isinstance(flush_tokens, int) or flush_tokens < 1:
        raise ValueError(f"flush_tokens={flush_tokens!r} must be an int >= 1")
    depth, max_children = tree_bounds(matcher_config)
    config = NgramPipelineConfig(
        matcher=matcher_config,
        tree_depth=depth,
        max_children=max_children,
        flush_tokens=flush_tokens,
        on_device=on_device,
    )
    common = dict(name="ngram", max_tokens_per_step=depth + 1, kv_lookahead=num_draft_tokens)
    if on_device:
        return Pipeline(
            prefill=functools.partial(device_prefill, config=config),
            decode=functools.partial(device_decode, config=config),
            **common,
        )
    device_round = functools.partial(verified_round, config=config)
    return Pipeline(
        prefill=functools.partial(prefill, config=config),
        decode=functools.partial(decode, config=config, corpus=corpus, device_round=device_round),
        host_work=True,
        device_round=device_round,
        **common,
    )
