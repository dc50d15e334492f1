"""Reference sampling: counter-based uniforms, filtered distributions and inverse-CDF draws.

Randomness is state, not a generator: every uniform is a pure function of a request's seed, a
stream, a counter (the token position the draw is for) and a column. A request's draws therefore
never depend on the batch it runs in, snapshot/restore replays bit-exactly, and a Triton kernel
can reproduce the same bits from the same four integers.

The hash is MurmurHash3_x86_32, with hash seed 0, of the 24 bytes
``struct.pack("<qIqI", seed, stream, counter, column)`` (six little-endian uint32 words: seed
low/high, stream, counter low/high, column). It is computed with int64 tensor ops whose
intermediates stay in ``[0, 2**49)``, so no backend overflows and signed and logical shifts agree.
Every step is a bijection of each word, so inputs that differ in one word never hash alike.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from speculum.spec.checks import checking, raise_for_rows
from speculum.state.record import make, replace
from speculum.state.sampling import Penalties, SamplingParams, TokenLogprobs

__all__ = [
    "Stream",
    "Fault",
    "describe_faults",
    "scaled_logits",
    "logit_faults",
    "biased_logits",
    "penalizing",
    "penalized_logits",
    "path_token_counts",
    "count_emitted",
    "grammar_logits",
    "reads_path",
    "drafting",
    "unpack_bitmask",
    "guard_logits",
    "token_logprobs",
    "no_logprobs",
    "first_fault",
    "draft_logits_guarded",
    "counter_uniforms",
    "uniforms",
    "filtered_probs",
    "sample",
    "sample_from_probs",
]

_MASK32 = 0xFFFFFFFF
# Uniforms keep 23 hash bits so that (m + 0.5) / 2**23 is exact in float32: with 24 bits the
# top midpoints fall half an ulp between floats and round (to even) onto each other and onto 1.0.
_UNIFORM_BITS = 23


class Stream(enum.IntEnum):
    """Independent random streams of one request; each stage draws from its own.

    Sharing one stream between drafting and acceptance correlates the draft token with its coin
    flip and biases the output distribution (vLLM shipped that bug).
    """

    SAMPLE = 0  # plain decoding and the token after a prefill
    DRAFT = 1  # drawing draft tokens
    ACCEPT = 2  # accept/reject coin flips
    RESAMPLE = 3  # the bonus token: residual after a rejection, or after the last accepted node


class Fault(enum.IntFlag):
    """Why a request's logits cannot be sampled: the bits of its per-round fault status.

    Decoding rounds report them per request instead of raising, so a scheduler can finish the
    one request that cannot be decoded and keep every other row of the batch going
    (``docs/embedding.md``, failure isolation).
    """

    NAN = 1  # a logit is NaN
    POSINF = 2  # a logit is +inf once divided by the temperature
    NO_TOKEN = 4  # every logit is -inf: nothing to draw


_FAULT_CAUSES = {
    Fault.NAN: "the model's logits contain NaN (its weights or activations for this request's "
    "tokens are not finite)",
    Fault.POSINF: "a logit overflows to +inf (in the model, or divided by a temperature too "
    "small for float32)",
    Fault.NO_TOKEN: "every logit is -inf, so no token can be drawn",
}


def describe_faults(faults: int) -> str:
    """The causes named by a fault status (an int of :class:`Fault` bits), joined by "; "."""
    return "; ".join(cause for bit, cause in _FAULT_CAUSES.items() if faults & bit)


def scaled_logits(
    logits: Float[Tensor, "batch *rows vocab"], temperature: Float[Tensor, " batch"]
) -> Float[Tensor, "batch *rows vocab"]:
    """``logits`` in float32 divided by each request's temperature (greedy rows,
    ``temperature <= 0``, by 1), exactly as :func:`filtered_probs` divides them."""
    x, t = logits.float(), temperature.float()
    return x / torch.where(t > 0, t, 1.0).reshape(t.shape + (1,) * (x.ndim - 1))


def logit_faults(
    logits: Float[Tensor, "batch *rows vocab"], temperature: Float[Tensor, " batch"] | None = None
) -> Int[Tensor, " batch *rows"]:
    """The :class:`Fault` bits of every distribution row of ``logits`` (0: it can be sampled).

    With ``temperature``, the logits are divided by it first (greedy rows, ``temperature <=
    0``, by 1) in float32, exactly as :func:`filtered_probs` divides them, so an overflow that
    sampling would meet is found here. Pure tensor code with no host sync: it runs inside
    compiled and captured rounds.

    One reduction reads the logits: a row's largest logit is NaN when any is (``amax``
    propagates NaN), ``+inf`` when any is, ``-inf`` only when all are; and dividing by a
    positive temperature is monotone, rounding included, so the largest scaled logit is the
    largest logit scaled.
    """
    largest = logits.float().amax(-1)
    if temperature is not None:
        largest = scaled_logits(largest[..., None], temperature)[..., 0]
    nan = largest.isnan()
    posinf = largest.isposinf()
    no_token = largest == float("-inf")
    return nan * int(Fault.NAN) + posinf * int(Fault.POSINF) + no_token * int(Fault.NO_TOKEN)


def biased_logits(
    logits: Float[Tensor, "batch *rows vocab"], bias: Float[Tensor, "batch vocab"] | None
) -> Float[Tensor, "batch *rows vocab"]:
    """``logits`` plus each request's logit bias (``SamplingParams.logit_bias``), in float32,
    at every row of the request: the bias depends on the token alone, not on its position, so
    every tree node and every step gets the same. ``bias`` None, or with no columns (an engine
    built without logit bias), returns ``logits`` as they are.
    """
    if bias is None or bias.shape[-1] == 0:
        return logits
    return logits.float() + bias.view(bias.shape[0], *([1] * (logits.dim() - 2)), bias.shape[1])


def penalizing(penalties: Penalties | None) -> bool:
    """Whether ``penalties`` apply anything: present and with columns (a static shape, so
    compiled and captured code branch on it without a sync)."""
    return penalties is not None and penalties.counts.shape[-1] > 0


def path_token_counts(
    path_tokens: Int[Tensor, "batch *rows length"], vocab: int
) -> Int[Tensor, "batch *rows vocab"]:
    """How many times each token occurs in each row's ``path_tokens`` (padding: -1), as int32
    counts over ``vocab`` tokens: one scatter-add, no host sync."""
    valid = path_tokens >= 0
    counts = torch.zeros(*path_tokens.shape[:-1], vocab, dtype=torch.int32, device=valid.device)
    return counts.scatter_add(-1, path_tokens.clamp(min=0), valid.to(torch.int32))


def penalized_logits(
    logits: Float[Tensor, "batch *rows vocab"],
    penalties: Penalties | None,
    path_tokens: Int[Tensor, "batch *rows length"] | None = None,
    columns: Int[Tensor, " vocab"] | None = None,
) -> Float[Tensor, "batch *rows vocab"]:
    """``logits`` with each request's ``min_tokens`` ban and its repetition, frequency and
    presence penalties applied, in float32, in vLLM's order (``docs/request_controls.md``):

    * while fewer than ``min_tokens`` tokens have been generated, the request's stop tokens
      (``Penalties.stops``) are set to ``-inf``;
    * ``repetition`` divides the positive logits and multiplies the negative ones of every
      token of the prompt or of the output (transformers' and vLLM's rule);
    * ``frequency`` times a token's count in the output, then ``presence`` once if it occurs
      there at all, are subtracted (OpenAI's rule).

    The output a row's distribution follows is every token emitted before the round
    (``Penalties.counts``, ``Penalties.num_output``) plus that row's ``path_tokens`` (padding:
    -1): the draft tokens on the tree path to the node it belongs to, root excluded, or the
    tokens a round already drew before it. Every row is thus penalized exactly as plain
    decoding would penalize the same sequence prefix. A request without penalties (repetition
    1, presence and frequency 0, min_tokens 0) gets its logits bit for bit. ``penalties``
    None, or with no columns, returns ``logits`` as they are. ``columns`` (a draft's reduced
    vocabulary, EAGLE-3's ``target_ids``) are the target token ids of the logits' columns,
    when they are not the whole vocabulary in order.
    """
    if not penalizing(penalties):
        return logits
    x = logits.float()
    rows = x.dim() - 2

    def per_request(v: Tensor) -> Tensor:  # [batch] -> broadcast against [batch, *rows, vocab]
        return v.view(v.shape[0], *([1] * (rows + 1)))

    def per_token(v: Tensor) -> Tensor:  # [batch, (*rows,) vocab] -> the logits' columns
        v = v if v.dim() == x.dim() else v.view(v.shape[0], *([1] * rows), v.shape[-1])
        return v if columns is None else v[..., columns]

    counts = per_token(penalties.counts)
    generated = per_request(penalties.num_output)
    if path_tokens is not None:
        vocab = penalties.counts.shape[-1]
        counts = counts + per_token(path_token_counts(path_tokens, vocab))
        generated = generated + (path_tokens >= 0).sum(-1, keepdim=True)
    banned = per_token(penalties.stops) & (generated < per_request(penalties.min_tokens))
    x = x.masked_fill(banned, float("-inf"))
    output = counts > 0
    repetition = per_request(penalties.repetition)
    repeated = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(output | per_token(penalties.prompt), repeated, x)
    x = x - per_request(penalties.frequency) * counts
    return x - per_request(penalties.presence) * output


def count_emitted(
    penalties: Penalties | None,
    tokens: Int[Tensor, "batch max_tokens"],
    num_tokens: Int[Tensor, " batch"],
) -> Penalties | None:
    """``penalties`` with each row's emitted ``tokens[b, :num_tokens[b]]`` added to its output
    counts: what a round's distributions read next round. Rejected drafts never pass here, so
    only what plain decoding would have generated is counted. No-op without penalties."""
    if not penalizing(penalties):
        return penalties
    steps = torch.arange(tokens.shape[1], device=tokens.device)
    emitted = (steps < num_tokens[:, None]) & (tokens >= 0)
    counts = penalties.counts.scatter_add(
        1, tokens.clamp(min=0), emitted.to(penalties.counts.dtype)
    )
    return replace(penalties, counts=counts, num_output=penalties.num_output + emitted.sum(1))


def reads_path(sampling: SamplingParams) -> bool:
    """Whether ``sampling``'s distributions depend on the tokens before them in the round (a
    penalty or a grammar does), so that every row must be handed its path tokens."""
    return penalizing(sampling.penalties) or sampling.grammar is not None


def drafting(sampling: SamplingParams) -> SamplingParams:
    """The controls a draft's distributions apply: ``sampling`` itself, or without its grammar
    when drafts are free (``SamplingParams.masked_drafts`` False): the draft then proposes
    from its unconstrained distribution, and only the target's are masked (acceptance stays
    exact, as for any draft; a sampled draft hands the verifier the unmasked distribution it
    drew from)."""
    if sampling.masked_drafts or sampling.grammar is None:
        return sampling
    return replace(sampling, grammar=None)


def unpack_bitmask(packed: Int[Tensor, "*rows words"], vocab: int) -> Bool[Tensor, "*rows vocab"]:
    """The bools of int32 bitmasks packed as xgrammar packs them (token ``t`` is bit ``t % 32``
    of word ``t // 32``), cut to ``vocab`` tokens. Pure tensor code: it runs on the device, so
    a round copies the packed words (1 bit a token) rather than a byte a token."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed[..., None] >> shifts) & 1  # [*rows, words, 32]
    return bits.flatten(-2)[..., :vocab].bool()


def grammar_logits(
    logits: Float[Tensor, "batch *rows vocab"],
    grammar: Callable[[Tensor], Tensor] | None,
    path_tokens: Int[Tensor, "batch *rows length"] | None = None,
    columns: Int[Tensor, " vocab"] | None = None,
) -> Float[Tensor, "batch *rows vocab"]:
    """``logits`` with ``-inf`` at every token the requests' grammars forbid after their
    output and each row's ``path_tokens`` (``SamplingParams.grammar``; None: no path, the
    output alone), in float32; ``grammar`` None returns them as they are. ``columns`` (a
    draft's reduced vocabulary, EAGLE-3's ``target_ids``) are the target token ids of the
    logits' columns, when they are not the whole vocabulary in order. The packed mask comes
    from the host (a grammar matcher walks each path): the host round trip of a round with
    a grammar."""
    if grammar is None:
        return logits
    if path_tokens is None:
        path_tokens = torch.full((*logits.shape[:-1], 0), -1, device=logits.device)
    packed = grammar(path_tokens)
    vocab = packed.shape[-1] * 32 if columns is not None else logits.shape[-1]
    allowed = unpack_bitmask(packed, vocab)
    allowed = allowed if columns is None else allowed[..., columns]
    return logits.float().masked_fill(~allowed, -math.inf)


def guard_logits(
    logits: Float[Tensor, "batch *rows vocab"],
    temperature: Float[Tensor, " batch"] | None = None,
    bias: Float[Tensor, "batch vocab"] | None = None,
    penalties: Penalties | None = None,
    path_tokens: Int[Tensor, "batch *rows length"] | None = None,
    grammar: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Float[Tensor, "batch *rows vocab"], Int[Tensor, " batch *rows"]]:
    """``logits`` (plus ``bias``, :func:`biased_logits`, then ``penalties`` over the output
    so far and each row's ``path_tokens``, :func:`penalized_logits`, then the ``grammar``'s
    mask after the same tokens, :func:`grammar_logits`, so that everything read from them sees
    all three) with every faulty row replaced by zeros, and each row's faults.

    A faulty row becomes a uniform distribution, so everything computed from it (draws, trees,
    acceptance) stays finite and defined; what it decides is meaningless, and its faults say
    so. Every other row passes unchanged, bit for bit: a tree node whose logits are NaN (a draft
    token with a broken embedding row, say) spoils only what that node decides.
    """
    logits = penalized_logits(biased_logits(logits, bias), penalties, path_tokens)
    logits = grammar_logits(logits, grammar, path_tokens)
    faults = logit_faults(logits, temperature)
    return logits.masked_fill((faults != 0)[..., None], 0.0), faults


def token_logprobs(
    logits: Float[Tensor, "batch tokens vocab"],
    temperature: Float[Tensor, " batch"],
    tokens: Int[Tensor, "batch tokens"],
    num_top: int,
) -> TokenLogprobs:
    """The log-probability of each ``tokens[b, d]`` under the distribution that decided it,
    ``logits[b, d]``, and that distribution's ``num_top`` most likely tokens (fewer when the
    vocabulary is smaller); :func:`no_logprobs` when ``num_top`` is 0, computing nothing.

    The distribution is ``log_softmax`` of the float32 logits divided by the request's
    temperature (greedy rows: the logits as they are), before top-k, top-p and min-p
    truncation, so greedy and truncated requests get meaningful values too
    (``docs/request_controls.md``). Padding tokens (-1) read entry 0. Pure tensor code of fixed
    shapes with no host sync: it runs inside compiled and captured rounds.
    """
    if num_top == 0:
        return no_logprobs(tokens)
    logprobs = torch.log_softmax(scaled_logits(logits, temperature), dim=-1)
    chosen = logprobs.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return make(TokenLogprobs, chosen=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def no_logprobs(tokens: Int[Tensor, "batch tokens"]) -> TokenLogprobs:
    """The log-probabilities a round reports when none are asked for: zeros and no
    alternatives. A record rather than ``None`` keeps every round's outputs tensors, as a
    captured round's must be, at the cost of one tiny fill."""
    none = tokens.new_zeros(*tokens.shape, 0)
    chosen = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    return make(TokenLogprobs, chosen=chosen, top_ids=none, top_logprobs=none.float())


def first_fault(
    faults: Int[Tensor, "batch steps"], num_tokens: Int[Tensor, " batch"]
) -> tuple[Int[Tensor, " batch"], Int[Tensor, " batch"]]:
    """Cut a round's emission at its first faulty step.

    ``faults[b, d]`` are the faults of the distribution that decided token ``d`` of row ``b``'s
    emission (``d < num_tokens[b]``; later columns are ignored). Tokens before the first faulty
    one were decided by usable distributions, exactly as one-token-at-a-time decoding would
    decide them, so they are kept. Returns the number of tokens kept and that step's faults (0
    for a row without any).
    """
    steps = torch.arange(faults.shape[1], device=faults.device)
    bad = (faults != 0) & (steps < num_tokens[:, None])
    first = torch.where(bad.any(1), bad.int().argmax(1), num_tokens)
    at = first.clamp(max=faults.shape[1] - 1)[:, None]
    return first, torch.where(bad.any(1), faults.gather(1, at)[:, 0], 0)


def draft_logits_guarded(
    logits: Float[Tensor, "batch *rows vocab"],
    temperature: Float[Tensor, " batch"] | None = None,
    bias: Float[Tensor, "batch vocab"] | None = None,
    penalties: Penalties | None = None,
    path_tokens: Int[Tensor, "batch *rows length"] | None = None,
    grammar: Callable[[Tensor], Tensor] | None = None,
) -> Float[Tensor, "batch *rows vocab"]:
    """:func:`guard_logits` for a draft: a faulty row drafts from a uniform distribution.
    ``bias``, ``penalties`` and ``grammar`` (the requests' logit bias, penalties and grammar
    masks, over the target's vocabulary, after each row's ``path_tokens``) make the draft
    propose what the controlled target will accept; acceptance is exact either way.

    A draft's faults are not reported: its tokens are proposals that the target verifies, and
    the distribution a proposal was drawn from (uniform, here) is what the verifier is given,
    so a broken draft lowers acceptance but never changes the output.
    """
    return guard_logits(logits, temperature, bias, penalties, path_tokens, grammar)[0]


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` and a 32-bit constant ``c``.

    The constant is split into 16-bit halves so no product exceeds ``2**48``: int64 never
    overflows, and the bits are the same on every backend. Only the low 16 bits of the high
    product survive the shift by 16, so those are all that are kept.
    """
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x, r: int):
    """Rotate a 32-bit value left by ``r`` (``x << r`` stays below ``2**63`` for ``r < 32``)."""
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _fmix32(h):
    """MurmurHash3's finaliser: a bijection of 32-bit values that avalanches every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _murmur3_32(words: list):
    """MurmurHash3_x86_32 with seed 0 of ``words`` (each a uint32 held in int64), elementwise.

    Written with plain operators only, so it runs unchanged on broadcastable int64 tensors and
    on Python ints (the tests check the published test vectors and every intermediate's range).
    """
    h = 0
    for word in words:
        k = _mul32(word, 0xCC9E2D51)
        k = _rotl32(k, 15)
        k = _mul32(k, 0x1B873593)
        h = _rotl32(h ^ k, 13)
        h = (h * 5 + 0xE6546B64) & _MASK32
    return _fmix32(h ^ (4 * len(words)))


def uniforms(
    seed: Int[Tensor, " batch"],
    stream: int,
    counter: Int[Tensor, " batch *rows"],
    width: int,
) -> Float[Tensor, "batch *rows width"]:
    """Counter-based float32 uniforms in the open interval (0, 1).

    Element ``[b, *r, j]`` is a pure function of ``(seed[b], stream, counter[b, *r], j)``: rows
    that pass the same counter get the same uniforms, so callers give every draw its own counter
    (its token position) or column. Values are ``((h >> 9) + 0.5) / 2**23`` for the 32-bit hash
    ``h``: 23 bits, every value exact in float32, the smallest ``2**-24`` and the largest
    ``1 - 2**-24``.
    """
    if seed.dtype != torch.int64 or counter.dtype != torch.int64:
        raise TypeError(
            f"uniforms takes int64 seed and counter, got {seed.dtype} and {counter.dtype}: "
            "a narrower dtype would change which bits are hashed"
        )
    if seed.ndim != 1 or counter.ndim < 1 or counter.shape[0] != seed.shape[0]:
        raise ValueError(
            f"uniforms: seed must be [batch] and counter [batch, *rows], got seed "
            f"{tuple(seed.shape)} and counter {tuple(counter.shape)}"
        )
    if not 0 <= int(stream) <= _MASK32:
        raise ValueError(f"uniforms: stream must fit in 32 bits, got {stream}")
    rows = counter.reshape(counter.shape[0], -1)
    return counter_uniforms(seed, rows, int(stream), width).view(*counter.shape, width)


@torch.library.custom_op("speculum::counter_uniforms", mutates_args=())
def counter_uniforms(seed: Tensor, counter: Tensor, stream: int, width: int) -> Tensor:
    """The ``speculum::counter_uniforms`` op: :func:`uniforms` over int64 ``seed [batch]`` and
    ``counter [batch, rows]``, unvalidated, as float32 ``[batch, rows, width]``.

    This default kernel is the hash in int64 tensor ops (~170 elementwise ops: as many kernel
    launches on a GPU); ``speculum.kernels.triton_sampling`` registers a one-launch CUDA twin
    with the same bits.
    """
    seed = seed[:, None, None]  # [batch, 1 (rows), 1 (width)]
    count = counter[..., None]
    column = torch.arange(width, dtype=torch.int64, device=counter.device)
    words = [
        seed & _MASK32,
        (seed >> 32) & _MASK32,
        stream,
        count & _MASK32,
        (count >> 32) & _MASK32,
        column,
    ]
    h = _murmur3_32(words)
    out = ((h >> (32 - _UNIFORM_BITS)).to(torch.float32) + 0.5) * 2.0**-_UNIFORM_BITS
    return out.expand(*counter.shape, width).contiguous()


@counter_uniforms.register_fake
def _(seed, counter, stream, width):
    return counter.new_empty((*counter.shape, width), dtype=torch.float32)


def _check_logits(logits: Float[Tensor, "batch *rows vocab"], params: SamplingParams) -> None:
    """Eager-side validation of logits and sampling parameters; compiled and captured code skip
    it (``spec.checks.checking``).

    Costs one device-to-host sync (all checks are packed into one tensor).
    """
    if not checking():
        return
    batch = logits.shape[0]
    for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
        shape = tuple(getattr(params, name).shape)
        if shape != (batch,):
            raise ValueError(
                f"SamplingParams.{name} has shape {shape} but the logits have batch {batch}: "
                "sampling parameters are per request, one entry per batch row"
            )
    x = logits.reshape(batch, -1, logits.shape[-1])
    t, k, p, m = params.temperature, params.top_k, params.top_p, params.min_p
    flags = [
        x.isnan().flatten(1).any(1),
        x.isposinf().flatten(1).any(1),
        (x == float("-inf")).all(-1).any(-1),
        ~(t >= 0) | ~t.isfinite(),
        k < 0,
        ~((p > 0) & (p <= 1)),
        ~((m >= 0) & (m <= 1)),
    ]
    problems = [
        "logits contain NaN",
        "logits contain +inf",
        "a row with every logit -inf (nothing to draw)",
        "temperature is negative or not finite (0 means greedy)",
        "top_k is negative (0 switches it off)",
        "top_p is outside (0, 1] (1 switches it off)",
        "min_p is outside [0, 1] (0 switches it off)",
    ]
    raise_for_rows(
        "cannot sample (non-finite logits come from the model or a mask upstream; sampling them "
        "would silently produce a token, so it is refused)",
        problems,
        flags,
    )


def _per_request(values: Tensor, ndim: int) -> Tensor:
    """Reshape a ``[batch]`` parameter to broadcast against a ``[batch, *rows, vocab]`` tensor."""
    return values.reshape(values.shape + (1,) * (ndim - 1))


def _filtered_probs_reference(
    logits: Float[Tensor, "batch *rows vocab"],
    temperature: Float[Tensor, " batch"],
    top_k: Int[Tensor, " batch"],
    top_p: Float[Tensor, " batch"],
    min_p: Float[Tensor, " batch"],
) -> Float[Tensor, "batch *rows vocab"]:
    """The math of :func:`filtered_probs`: the default kernel of ``speculum::filtered_probs``.

    Parity tests call it directly, so a device kernel registered for the op is compared with
    this and not with itself.
    """
    x = logits.float()
    vocab = x.shape[-1]
    temperature = _per_request(temperature.float(), x.ndim)
    greedy = temperature == 0
    scaled = x / torch.where(greedy, 1.0, temperature)
    probs = torch.softmax(scaled, dim=-1)

    # Filters act on the descending order of the scaled logits; the stable sort puts tied tokens
    # lowest index first, which is what "keep exactly k, lowest index first" means.
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    sorted_p = probs.gather(-1, order)
    rank = torch.arange(vocab, device=x.device)

    top_k = _per_request(top_k, x.ndim)
    in_top_k = (top_k <= 0) | (rank < top_k)

    # top-p sees the top-k distribution renormalised; a token stays while the mass of the tokens
    # before it is still short of top_p. top_p == 1 is "off" even where the float cumsum of the
    # tail rounds up to 1 before the last token.
    top_p = _per_request(top_p.float(), x.ndim)
    topk_p = sorted_p * in_top_k
    renorm = topk_p / topk_p.sum(-1, keepdim=True)
    mass_before = F.pad(renorm.cumsum(-1)[..., :-1], (1, 0))
    in_top_p = (top_p >= 1) | (mass_before < top_p)

    min_p = _per_request(min_p.float(), x.ndim)
    in_min_p = sorted_p >= min_p * sorted_p[..., :1]

    # The most likely token always survives, so every row keeps at least one token.
    keep_sorted = (in_top_k & in_top_p & in_min_p) | (rank == 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    filtered = kept / kept.sum(-1, keepdim=True)

    one_hot = F.one_hot(x.argmax(-1), vocab).to(torch.float32)
    return torch.where(greedy, one_hot, filtered)


# The schemas are spelled out because infer_schema reads only bare ``Tensor`` annotations, and the
# jaxtyping ones document the shapes. Parameters come as separate tensors: a schema takes no
# records.
@torch.library.custom_op(
    "speculum::filtered_probs",
    mutates_args=(),
    schema=(
        "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor"
    ),
)
def _filtered_probs_op(
    logits: Float[Tensor, "batch *rows vocab"],
    temperature: Float[Tensor, " batch"],
    top_k: Int[Tensor, " batch"],
    top_p: Float[Tensor, " batch"],
    min_p: Float[Tensor, " batch"],
) -> Float[Tensor, "batch *rows vocab"]:
    """``speculum::filtered_probs``: the reference by default, a device kernel where registered."""
    return _filtered_probs_reference(logits, temperature, top_k, top_p, min_p)


@_filtered_probs_op.register_fake
def _(logits, temperature, top_k, top_p, min_p):
    return torch.empty_like(logits, dtype=torch.float32)


def _filtered_probs_core(
    logits: Float[Tensor, "batch *rows vocab"], params: SamplingParams
) -> Float[Tensor, "batch *rows vocab"]:
    """:func:`filtered_probs` without validation, through the op (so CUDA gets its kernel).

    Where ``params.filters`` says a row has a top-k, top-p or min-p filter, those rows take the
    reference (a sort) and the others the op with no filter: on the H200 the Triton kernel's
    threshold search takes 2.1-3.0 ms a filtered row of 128256 tokens at 1-64 rows against the
    sort's 0.5-1.6 ms, while rows without a filter are 2-25x faster through it
    (docs/benchmarks.md, sampling filters). Each row's result depends on its own settings
    alone, whichever rows share its batch.
    """
    temperature, top_k, top_p, min_p = params.temperature, params.top_k, params.top_p, params.min_p
    if not params.filters:
        return _filtered_probs_op(logits, temperature, top_k, top_p, min_p)
    filtered = _per_request((top_k > 0) | (top_p < 1) | (min_p > 0), logits.ndim)
    off = torch.zeros_like(top_k), torch.ones_like(top_p), torch.zeros_like(min_p)
    unfiltered = _filtered_probs_op(logits, temperature, *off)
    return torch.where(
        filtered, _filtered_probs_reference(logits, temperature, top_k, top_p, min_p), unfiltered
    )


def filtered_probs(
    logits: Float[Tensor, "batch *rows vocab"], params: SamplingParams
) -> Float[Tensor, "batch *rows vocab"]:
    """The float32 distribution each request samples from, after every filter.

    Greedy requests (``temperature == 0``) get the one-hot of the argmax (lowest index on ties).
    Others get ``softmax(logits / temperature)``, then top-k (the ``k`` largest; ties at the
    k-th value keep exactly ``k``, lowest index first), then top-p over the renormalised top-k
    distribution (the shortest prefix of the descending order whose mass reaches ``top_p``),
    then min-p (drop tokens below ``min_p`` times the largest probability), renormalised. The
    most likely token is always kept. Parameters broadcast per request over ``*rows``.

    In eager mode, NaN or +inf logits, a row of all ``-inf`` and out-of-range parameters raise
    ``ValueError`` naming the batch rows; under ``torch.compile`` the check is skipped.
    """
    _check_logits(logits, params)
    return _filtered_probs_core(logits, params)


def _sample_from_probs_reference(
    probs: Float[Tensor, "batch *rows vocab"], u: Float[Tensor, " batch *rows"]
) -> Int[Tensor, " batch *rows"]:
    """The math of :func:`sample_from_probs`: the default kernel of its op.

    Parity tests call it directly, as they call :func:`_filtered_probs_reference`.
    """
    cdf = probs.float().cumsum(-1)
    target = (u.float() * cdf[..., -1])[..., None]
    index = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)[..., 0]
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_positive = torch.where(probs > 0, positions, 0).amax(-1)
    return torch.minimum(index, last_positive)


@torch.library.custom_op(
    "speculum::sample_from_probs", mutates_args=(), schema="(Tensor probs, Tensor u) -> Tensor"
)
def _sample_from_probs_op(
    probs: Float[Tensor, "batch *rows vocab"], u: Float[Tensor, " batch *rows"]
) -> Int[Tensor, " batch *rows"]:
    """``speculum::sample_from_probs``: the reference by default, a device kernel if registered."""
    return _sample_from_probs_reference(probs, u)


@_sample_from_probs_op.register_fake
def _(probs, u):
    return probs.new_empty(probs.shape[:-1], dtype=torch.int64)


def sample_from_probs(
    probs: Float[Tensor, "batch *rows vocab"], u: Float[Tensor, " batch *rows"]
) -> Int[Tensor, " batch *rows"]:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds ``u``.

    ``probs`` need not be normalised (``u`` is scaled by each row's total, so residual
    distributions ``max(p - q, 0)`` can be passed as they are); ``u`` must lie in (0, 1). A token
    of probability zero is never returned: its cumulative sum equals its predecessor's, so the
    search stops earlier, and a ``u`` that float rounding puts past the last step is clamped to
    the last token with positive probability. Rows whose total mass is zero return token 0; a
    total below float32's normal range (~1e-38) makes ``u * total`` coarse.
    """
    return _sample_from_probs_op(probs, u)


def sample(
    logits: Float[Tensor, "batch vocab"],
    params: SamplingParams,
    counter: Int[Tensor, " batch"],
    stream: int = Stream.SAMPLE,
) -> Int[Tensor, " batch"]:
    """One token per request: argmax for greedy requests, else a draw from :func:`filtered_probs`.

    The draw uses one uniform, ``uniforms(params.seed, stream, counter, 1)``, where ``counter``
    is the position the sampled token will occupy; a request's token therefore depends only on
    its own logits, parameters, seed and position, never on the rest of the batch. Validation
    as in :func:`filtered_probs`.
    """
    _check_logits(logits, params)
    if tuple(counter.shape) != (logits.shape[0],):
        raise ValueError(
            f"sample: counter must be [batch] = ({logits.shape[0]},), got {tuple(counter.shape)}"
        )
    probs = _filtered_probs_core(logits, params)
    u = uniforms(params.seed, stream, counter, 1)[..., 0]
    greedy = params.temperature == 0
    return torch.where(greedy, logits.argmax(-1), sample_from_probs(probs, u))
