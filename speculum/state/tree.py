"""Records of one speculative round: draft candidates, the draft tree, and what verify accepted."""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from speculum.state.record import record, static
from speculum.state.sampling import TokenLogprobs

__all__ = ["DraftCandidates", "DraftTree", "AcceptResult", "Verified"]


@record
class DraftCandidates:
    """Every token the draft proposed in one round, in level order (EAGLE-2).

    Step 0 contributes ``topk`` candidates (children of the root); each later step contributes
    ``topk * topk`` (``topk`` children of each of the ``topk`` frontier nodes). ``parents[b, i]``
    is the index of candidate ``i``'s parent candidate, ``-1`` for children of the root, and is
    always smaller than ``i``. ``scores`` are cumulative draft probabilities (the product along
    the path), so a child never outscores its parent.
    """

    tokens: Int[Tensor, "batch num_candidates"]
    parents: Int[Tensor, "batch num_candidates"]
    scores: Float[Tensor, "batch num_candidates"]


@record
class DraftTree:
    """A batch of draft trees of ``num_nodes`` nodes each; node 0 is the root.

    The root holds the last verified token (the previous round's bonus token), whose K/V is not
    yet in the target cache; nodes ``1 ..`` are draft tokens in level order, so every node's
    parent has a smaller index (EAGLE-2 top-k trees also have distinct sibling tokens; accept does
    not require it, sampled trees may repeat one). ``depths[b, 0] == 0``;
    ``parents[b, 0] == -1``.
    """

    tokens: Int[Tensor, "batch num_nodes"]
    parents: Int[Tensor, "batch num_nodes"]
    depths: Int[Tensor, "batch num_nodes"]


@record
class AcceptResult:
    """What verification kept of each request's tree.

    ``path[b, :num_accepted[b] + 1]`` are the node indices of the root and the accepted draft
    nodes, root first; ``emitted[b, :num_accepted[b] + 1]`` are the accepted draft tokens then
    the bonus token. Unused entries are -1; ``max_emit == max_depth + 1``. ``num_accepted``
    excludes the bonus: ``num_accepted + 1`` tokens are emitted per round (the acceptance length,
    bonus included).

    ``chain`` (static) says the tree was a chain, every node at most one child (``accept``'s
    ``max_children == 1``): the accepted node at depth ``d`` is then node ``d``, so commit moves
    nothing (``spec.recurrent.commit_states`` skips its copy). ``False`` is always safe.
    """

    path: Int[Tensor, "batch max_emit"]
    emitted: Int[Tensor, "batch max_emit"]
    num_accepted: Int[Tensor, " batch"]
    chain: bool = static(default=False)


@record
class Verified:
    """The target's view of a tree: its features at every node, its acceptance decision, and
    the fault status of its distribution at every node (``spec.sampling.Fault`` bits, 0 where
    the logits were usable). What a faulty node decides is meaningless; only faults on the
    accepted path spoil the emission (``pipelines.base.verified_output``). ``logprobs`` are
    the target's log-probabilities of the emitted tokens, each read from the distribution at
    the path node that decided it (``spec.verify.path_logprobs``; empty unless the sampling
    settings ask for them, ``None`` only in records built without)."""

    accepted: AcceptResult
    final_hidden: Float[Tensor, "batch num_nodes hidden"]
    captured: tuple[Float[Tensor, "batch num_nodes hidden"], ...]
    faults: Int[Tensor, "batch num_nodes"]
    logprobs: TokenLogprobs | None = None
