"""Records of the draft side of a speculative round: its static shape, its carried prediction,
and the batch state between rounds."""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from speculum.state.kv import PagedKV
from speculum.state.record import record, static
from speculum.state.sampling import SamplingParams

__all__ = ["EagleConfig", "DraftPrediction", "EagleState"]


@record
class EagleConfig:
    """Static shape of a round: draft depth, branching, tree size and how drafts are chosen.

    ``sample_drafts`` draws draft tokens from the draft's filtered distribution instead of
    taking its top-k: ``topk`` independent chains of ``num_steps`` tokens, all verified.
    """

    num_steps: int = static()
    topk: int = static()
    num_draft_tokens: int = static()
    sample_drafts: bool = static(default=False)


@record
class DraftPrediction:
    """The draft's prediction at a request's last committed position.

    ``hidden`` is the draft's output there (the input hidden of the first draft step);
    ``top_probs`` / ``top_tokens`` are its ``topk`` most likely next tokens.
    """

    hidden: Float[Tensor, "batch hidden"]
    top_probs: Float[Tensor, "batch topk"]
    top_tokens: Int[Tensor, "batch topk"]


@record
class EagleState:
    """Batch state between rounds.

    ``kv.seq_lens`` counts the tokens whose K/V are in both caches; ``root_tokens`` is the last
    verified token (emitted, not yet in the caches), the root of the next tree.
    """

    kv: PagedKV
    root_tokens: Int[Tensor, " batch"]
    prediction: DraftPrediction
    sampling: SamplingParams
