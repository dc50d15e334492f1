"""An engine: a pipeline value plus the resources it runs on and the scheduler's limits."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch

from speculum.models.block_draft import load_block_draft
from speculum.models.config import UnsupportedModel
from speculum.models.decoder import (
    GEMV_KINDS,
    DecoderModel,
    fuse_projections_,
    gemv_projections_,
    widest_window,
)
from speculum.models.draft_loading import load_draft
from speculum.models.frozen_kv import load_frozen_kv
from speculum.models.loading import DTYPES, load_model
from speculum.models.multi_layer_eagle import load_multi_layer
from speculum.models.standalone import StandaloneHead, load_standalone
from speculum.models.tokenizer import Tokenizer, load_tokenizer
from speculum.pipelines import ADAPTIVE, BLOCK, SPECULATIVE, adaptive, get_pipeline, ngram
from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.pipelines.base import Cell, Pipeline, Resources, counting, free_drafts
from speculum.runtime import checks
from speculum.runtime.compiled import CompiledDecode, check_stages, compile_round
from speculum.runtime.graphs import DEFAULT_BUCKETS, GraphedDecode
from speculum.runtime.mla_kernel import (
    MLA_KERNELS,
    check_mla_kernel,
    round_forwards,
    with_latent_plans,
)
from speculum.spec.ngram import load_corpus, new_store
from speculum.state.parallel import SINGLE, TensorParallel
from speculum.state.prefix import PrefixIndex

T = TypeVar("T")

__all__ = [
    "EngineConfig",
    "Engine",
    "SpecOptions",
    "NgramOptions",
    "build_engine",
    "engine_from_model",
    "reserved_lookahead",
    "kv_window",
    "decode_steps",
    "GPU_DECODE_STEPS",
    "GRAMMAR_DRAFTS",
    "check_gemv",
]


def _count(minimum: int) -> attrs.Converter:
    """The converter of a count setting: an integer >= ``minimum``."""
    return checks.converter(checks.integer, minimum=minimum)


def _optional_count(minimum: int) -> attrs.Converter:
    """The converter of a count setting that ``None`` leaves to a default."""
    return checks.converter(checks.integer, optional=True, minimum=minimum)


_FLAG = checks.converter(checks.flag)


def check_gemv(value: object) -> tuple[str, ...]:
    """``half_gemv`` (``EngineConfig``) as a sorted tuple of :data:`GEMV_KINDS`; empty, the
    default, leaves every projection to ``F.linear``."""
    return checks.names(
        "half_gemv",
        value,
        among=GEMV_KINDS,
        items="projection kinds",
        kinds="projections",
        example="('qkv', 'o')",
    )


def _buckets(value: object) -> tuple[int, ...]:
    """CUDA-graph batch buckets: batch sizes >= 1, at least one."""
    buckets = checks.integers("graph_buckets", value, minimum=1)
    if not buckets:
        raise ValueError("graph_buckets=(): give at least one batch size, e.g. (1, 2, 4, 8)")
    return buckets


@attrs.define(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Scheduler limits (KV pages, batch size, context length, prefill chunking), whether the
    models' projections are fused (q/k/v and gate/up as one matmul each, see
    ``models.decoder.fuse_projections_``), on CUDA whether decoding rounds run as CUDA graphs
    and for which batch-size buckets, and whether the scheduler overlaps the host's work for
    the next step with the device's current one (``overlap``, ``docs/overlap.md``).
    ``max_logprobs`` is the most top alternatives a request may ask to see with each generated
    token's log-probability (``scheduler.Sampling.logprobs``); 0, the default, computes no
    log-probabilities at all, and any other value computes that many for every token of every
    round (a softmax and a top-k over the vocabulary per emitted token;
    ``docs/request_controls.md``). ``logit_bias`` lets requests carry a logit bias
    (``scheduler.Sampling.logit_bias``): a ``[batch, vocab]`` float32 row per request, added to
    every target distribution; False, the default, adds nothing and stores nothing.
    ``penalties`` lets requests carry repetition, presence and frequency penalties and
    ``min_tokens`` (``scheduler.Sampling``): per request, an int32 count and two bool rows over
    the vocabulary on the device (6 bytes per token: 0.9 MB at a 150k vocabulary), read by
    every distribution and updated by every round (``pipelines.base.counting``); False, the
    default, stores and applies nothing.
    ``prefix_cache`` (on by default) lets requests reuse the KV pages of prompt prefixes
    earlier requests computed (``docs/prefix_cache.md``; :attr:`Engine.prefix_lookahead` says
    for which pipelines). ``free_window_pages`` (on by default) returns a request's pages
    wholly outside every layer's sliding window to the pool as it decodes, where that is exact
    (:attr:`Engine.kv_window`; ``docs/sliding_window.md``); off, every page is kept until the
    request ends.
    ``compile_stages`` names the parts of a decoding round ``torch.compile`` fuses
    (``runtime.compiled.STAGES``): ``"round"`` compiles the round between the hand kernels,
    and ``"model_ops"``, ``"sampling"``, ``"tree"`` also replace those hand kernels by
    inductor's code for their reference math; empty, the default, compiles nothing (the
    hand-written path; ``docs/gpu.md``, "Compiled stages").
    ``mla_kernel`` picks the kernel of a DeepSeek target's latent attention in decoding
    rounds (``runtime.mla_kernel``, ``docs/mla.md``): ``"triton"``, the default, speculum's
    latent kernel, or ``"flashinfer"``, flashinfer's MLA kernel planned on the host before
    each round (synchronous scheduling, plain decoding and chain verifies, CUDA, bfloat16 or
    float16).
    ``half_gemv`` names the float projections (``models.decoder.GEMV_KINDS``: ``"qkv"``,
    ``"o"``, ``"gate_up"``, ``"down"``, ``"lm_head"``) whose decode-sized matmuls run the
    Triton matrix-vector kernel on CUDA instead of cuBLAS (``kernels.half``); empty, the
    default, runs cuBLAS everywhere (``docs/gpu.md``, "Half-precision GEMV").

    Checked when built (``runtime.checks``): counts are integers, not floats or bools,
    ``num_pages >= 0`` (0 until :func:`engine_from_model` sizes the pool), ``max_context >= 2``
    (a prompt token and a generated one), the other counts ``>= 1``; flags are bools;
    ``compile_stages`` known stage names, with ``max_batch`` at most the largest bucket (a
    compiled round runs padded to one)."""

    page_size: int = attrs.field(default=16, converter=_count(1))
    num_pages: int = attrs.field(default=0, converter=_count(0))
    max_batch: int = attrs.field(default=16, converter=_count(1))
    max_context: int = attrs.field(default=1024, converter=_count(2))
    prefill_budget: int = attrs.field(default=512, converter=_count(1))
    cuda_graphs: bool = attrs.field(default=True, converter=_FLAG)
    graph_buckets: tuple[int, ...] = attrs.field(default=DEFAULT_BUCKETS, converter=_buckets)
    fuse_projections: bool = attrs.field(default=True, converter=_FLAG)
    overlap: bool = attrs.field(default=False, converter=_FLAG)
    max_logprobs: int = attrs.field(default=0, converter=_count(0))
    logit_bias: bool = attrs.field(default=False, converter=_FLAG)
    penalties: bool = attrs.field(default=False, converter=_FLAG)
    prefix_cache: bool = attrs.field(default=True, converter=_FLAG)
    free_window_pages: bool = attrs.field(default=True, converter=_FLAG)
    compile_stages: tuple[str, ...] = attrs.field(default=(), converter=check_stages)
    mla_kernel: str = attrs.field(
        default="triton", converter=checks.converter(checks.choice, among=MLA_KERNELS)
    )
    half_gemv: tuple[str, ...] = attrs.field(default=(), converter=check_gemv)

    def __attrs_post_init__(self) -> None:
        # A compiled round runs padded to a bucket on every device; a captured one only on
        # CUDA, which engine_from_model checks once it knows the device.
        if self.compile_stages and self.max_batch > max(self.graph_buckets):
            raise ValueError(
                f"max_batch={self.max_batch} exceeds the largest batch bucket "
                f"{max(self.graph_buckets)}, and compiled rounds (compile_stages="
                f"{self.compile_stages}) run padded to a bucket: add a larger bucket to "
                "graph_buckets, lower max_batch, or drop compile_stages"
            )

    def max_pages_per_request(self, lookahead: int) -> int:
        """Page-table width: a full context plus the pipeline's lookahead slots."""
        return math.ceil((self.max_context + lookahead) / self.page_size)


@attrs.define(frozen=True, slots=True, kw_only=True, eq=False)
class Engine:
    """What the scheduler's pure functions run against (the pools are written in place).

    ``owner`` holds the token of the one scheduler state that may step the engine next (the
    pools hold one state's pages; ``scheduler.new_state`` and ``scheduler.restore`` claim
    them, each step hands the claim on to the state it returns). An engine derived with
    ``attrs.evolve`` shares its resources and so its owner cell. ``prefix_index`` holds the
    prefix cache (``state.prefix.PrefixIndex``) of that owner, from which a new scheduler
    state starts: the cache outlives the states that fill it.
    """

    pipeline: Pipeline
    resources: Resources
    config: EngineConfig
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    owner: Cell = attrs.field(factory=lambda: Cell(None))
    prefix_index: Cell = attrs.field(factory=lambda: Cell(PrefixIndex()))
    #: How far back from its own position any query of the engine's models reads the KV
    #: cache, where a request's pages wholly before that go back to the pool as it decodes
    #: (:func:`kv_window`); computed once, when the engine is built (the scheduler reads it
    #: for every request of every step).
    kv_window: int | None = attrs.field(
        init=False, default=attrs.Factory(lambda engine: kv_window(engine), takes_self=True)
    )

    @property
    def device(self) -> torch.device:
        """The device the target model runs on."""
        return self.resources.target_pool.k.device

    @property
    def kv_lookahead(self) -> int:
        """Cache slots reserved per request past its token budget (:func:`reserved_lookahead`)."""
        return reserved_lookahead(self.pipeline, self.config.overlap)

    @property
    def prefix_lookahead(self) -> int | None:
        """How many tokens past a page its cached contents depend on, or ``None`` where
        prefix caching is off (``EngineConfig.prefix_cache``) or cannot be exact for the
        pipeline (``docs/prefix_cache.md``).

        The target's K/V at a position depend on the tokens up to it, and so do the caches
        of n-gram, frozen-KV MTP (it has none), DFLASH/DSPARK (injected context) and
        standalone drafts (entry ``i`` holds token ``i``): 0. An EAGLE-family head's entry
        ``i`` pairs the target's hidden state ``i`` with token ``i + 1``: 1. Multi-layer EAGLE's
        later layers pair entries with tokens further on, near a chunk's end with their own
        predictions, which depend on how the prompt was chunked: not cached. Nor is any
        pipeline this list does not know. Nor a model with recurrent state (hybrid targets or
        drafts): a shared page holds K/V, not the recurrent state at its end, so caching is off
        for them until that state is cached at page boundaries."""
        recurrent = any(pool.recurrent is not None for pool in self.resources.pools)
        if not self.config.prefix_cache or recurrent:
            return None
        name = self.pipeline.name
        if name in _PREFIX_EXACT:
            return 0
        if name in _PREFIX_PAIRED:
            return 1 - self.resources.draft.ahead
        return None

    @property
    def tp(self) -> TensorParallel:
        """The tensor-parallel group the target is sharded over (``SINGLE``: one process, also
        for a target of another kind than ``DecoderModel``, which knows no sharding)."""
        return getattr(self.resources.target, "tp", SINGLE)


#: Pipelines whose caches at a position depend only on the tokens up to it
#: (:attr:`Engine.prefix_lookahead`).
_PREFIX_EXACT = frozenset({"plain", "ngram", "frozen_kv_mtp", "dflash", "dspark"})
#: The EAGLE family and STANDALONE (adaptive included): their heads pair entry ``i`` with token
#: ``i + 1 - ahead``.
_PREFIX_PAIRED = frozenset({"eagle", "eagle3", "mtp", "nextn", "standalone", "adaptive"})


def kv_window(engine: Engine) -> int | None:
    """How far back from its own position any query of the engine's models reads the KV
    cache, when a request's pages wholly before that go back to the pool as it decodes
    (``docs/sliding_window.md``): every attention layer of the target and of the draft is
    windowed (``models.decoder.widest_window``: Mistral with ``sliding_window``, Qwen3-MoE
    with ``use_sliding_window``, and EAGLE, MTP or standalone drafts of the same kind; not
    gpt-oss's or Qwen's full layers, nor EAGLE-3's Llama midlayer) and the pipeline keeps
    its caches filled up to the last emitted token (plain, n-gram and the EAGLE
    composition; not adaptive speculation, block or frozen-KV drafts). None otherwise, or with
    ``EngineConfig.free_window_pages`` off: every page is kept until the request ends."""
    if not engine.config.free_window_pages or engine.pipeline.name not in _WINDOW_PAGED:
        return None
    models = [m for m in (engine.resources.target, engine.resources.draft) if m is not None]
    windows = [widest_window(m) if isinstance(m, torch.nn.Module) else None for m in models]
    return None if None in windows else max(windows)


#: Pipelines whose caches hold every token but the last emitted one (``kv.seq_lens``), so that a
#: round's queries sit at that length or later (:attr:`Engine.kv_window`).
_WINDOW_PAGED = frozenset({"plain", "ngram", "eagle", "eagle3", "mtp", "nextn", "standalone"})


def reserved_lookahead(pipeline: Pipeline, overlap: bool) -> int:
    """The pipeline's lookahead and, when overlapped, one round more: a request that has
    finished runs one extra round, whose output is discarded, before its finish is known, and
    that round may start up to ``max_tokens_per_step`` tokens past the request's budget."""
    return pipeline.kv_lookahead + (pipeline.max_tokens_per_step if overlap else 0)


def _verify_budget(value: object) -> str | int:
    """A block round's verify budget: a word (``"all"``, ``"auto"``: the pipeline checks
    which) or a number of draft tokens >= 0."""
    if isinstance(value, str):
        return value
    return checks.integer(
        "verify_budget", value, minimum=0, fix="the other budgets are the words 'all' and 'auto'"
    )


#: What a request's grammar masks under speculation (``SpecOptions.grammar_drafts``): the
#: draft's distributions too, or the target's alone.
GRAMMAR_DRAFTS = ("masked", "free")


@attrs.define(frozen=True, slots=True, kw_only=True)
class SpecOptions:
    """Shape of a speculative round: draft depth, branching and tree size (root included).

    ``num_draft_tokens`` defaults to ``num_steps + 1`` for chains (``topk == 1``).
    ``sample_drafts`` draws drafts from the draft's filtered distribution (``topk``
    independent chains) instead of taking its top-k. ``chain_hidden`` (multi-layer EAGLE only)
    feeds each MTP layer's output hidden state into the next layer.

    ``adaptive_steps`` (EAGLE family and STANDALONE, chains only) replaces ``num_steps`` with
    several draft depths, 0 meaning no speculation; each round runs the one with the best
    measured goodput at the batch's size, chosen by ``adaptive_policy``
    (``speculum.pipelines.adaptive``, ``docs/adaptive.md``).
    Block drafters (``dflash``, ``dspark``) ignore ``num_steps``, ``topk`` and
    ``num_draft_tokens``: ``block_size`` is the block width (default: the draft's own), and
    ``verify_budget`` (``"all"``, ``"auto"`` or a number of draft tokens per round over the
    batch), ``cost_table`` (``(tokens, seconds)`` points, for ``"auto"``) and ``min_verify``
    (draft tokens each request verifies at least) choose how many draft tokens are verified
    (see ``docs/dspark.md``); ``packed_verify`` (default) runs a fixed budget's target
    forward over the verified tokens alone, packed, instead of every row's whole block.

    ``grammar_drafts`` says what a request's grammar (structured output) masks:
    ``"masked"`` (default), the draft's distributions as well as the target's, so drafts are
    legal and acceptance high, at one host round trip per draft level; ``"free"``, the
    target's alone (SGLang's EAGLE does so), one round trip a round. Both are exact
    (``docs/request_controls.md``, "Masked or free drafts").

    ``decode_steps`` (``algorithm="plain"`` only) is how many plain decoding steps a round
    runs in one launch (one CUDA graph): the scheduler checks stop conditions after the
    launch and drops the tokens past a stop (``docs/gpu.md``, "Multi-step decoding"). ``None``
    picks the device's default: 1 on the CPU, :data:`GPU_DECODE_STEPS` on CUDA.

    Checked when built, for types and signs (the pipelines check how the settings fit
    together): counts are integers (not floats or bools), ``num_steps``, ``topk``,
    ``num_draft_tokens``, ``block_size`` and ``decode_steps`` ``>= 1``, ``adaptive_steps``
    and ``min_verify`` ``>= 0``, ``verify_budget`` a word or an integer ``>= 0``,
    ``grammar_drafts`` one of :data:`GRAMMAR_DRAFTS`; flags are bools.
    """

    num_steps: int = attrs.field(default=3, converter=_count(1))
    topk: int = attrs.field(default=1, converter=_count(1))
    num_draft_tokens: int | None = attrs.field(default=None, converter=_optional_count(1))
    sample_drafts: bool = attrs.field(default=False, converter=_FLAG)
    chain_hidden: bool = attrs.field(default=True, converter=_FLAG)
    adaptive_steps: tuple[int, ...] = attrs.field(
        default=(), converter=checks.converter(checks.integers, minimum=0)
    )
    adaptive_policy: AdaptivePolicy = attrs.field(
        factory=AdaptivePolicy, converter=checks.converter(checks.instance, kind=AdaptivePolicy)
    )
    block_size: int | None = attrs.field(default=None, converter=_optional_count(1))
    verify_budget: str | int = attrs.field(default="all", converter=_verify_budget)
    cost_table: tuple[tuple[int, float], ...] | None = None
    min_verify: int = attrs.field(default=0, converter=_count(0))
    packed_verify: bool = attrs.field(default=True, converter=_FLAG)
    decode_steps: int | None = attrs.field(default=None, converter=_optional_count(1))
    grammar_drafts: str = attrs.field(
        default="masked", converter=checks.converter(checks.choice, among=GRAMMAR_DRAFTS)
    )


#: Plain decoding steps per round on CUDA when ``SpecOptions.decode_steps`` is not given.
GPU_DECODE_STEPS = 4


@attrs.define(frozen=True, slots=True, kw_only=True)
class NgramOptions:
    """N-gram drafting (``algorithm="ngram"``, no draft model; see ``docs/ngram.md``).

    Suffixes of ``min_match .. max_depth`` tokens are matched, longest first, against the
    request's own tokens, a store of earlier token streams shared by all requests (a ring of
    ``store_tokens`` entries; 0 switches it off, None is 1048576 for the host matcher and 0
    for the device one) and the optional ``corpus`` file (``.npy`` ids with -1 between
    documents, or one document of ids per line). The first tree level takes between
    ``min_breadth`` (longest match) and ``max_breadth`` (one-token match) children, in
    ``order`` ``"recency"`` or ``"frequency"``. The tree size is ``SpecOptions.num_draft_tokens``
    (default 8, root included); ``num_steps`` and ``topk`` do not apply.

    ``matcher`` is where drafts are matched: ``"host"`` (those trees, built in Python before
    each round) or ``"device"`` (one chain per request from its own history, inside the
    captured round, overlappable; no store, no corpus, no breadth or order settings:
    ``docs/ngram.md``).

    Checked when built, for types and signs (the pipeline checks how they fit together):
    counts are integers ``>= 1`` (``store_tokens >= 0``), ``order`` a string, ``corpus`` a
    path or None, and the device matcher without what only the host matcher reads.
    """

    max_depth: int = attrs.field(default=18, converter=_count(1))
    min_match: int = attrs.field(default=1, converter=_count(1))
    min_breadth: int = attrs.field(default=1, converter=_count(1))
    max_breadth: int = attrs.field(default=10, converter=_count(1))
    order: str = attrs.field(
        default="recency", converter=checks.converter(checks.instance, kind=str)
    )
    store_tokens: int | None = attrs.field(default=None, converter=_optional_count(0))
    corpus: str | Path | None = attrs.field(
        default=None,
        converter=checks.converter(checks.instance, optional=True, kind=(str, os.PathLike)),
    )
    max_occurrences: int = attrs.field(default=256, converter=_count(1))
    flush_tokens: int = attrs.field(default=32, converter=_count(1))
    matcher: str = attrs.field(
        default="host", converter=checks.converter(checks.instance, kind=str)
    )

    def __attrs_post_init__(self) -> None:
        ngram.validate_matcher(
            self.matcher,
            corpus=self.corpus,
            store=bool(self.store_tokens),
            **{k: getattr(self, k) for k in ngram.HOST_ONLY},
        )

    @property
    def store_size(self) -> int:
        """The shared store's budget in tokens: ``store_tokens``, or its matcher's default."""
        if self.store_tokens is not None:
            return self.store_tokens
        return 0 if self.matcher == "device" else 1 << 20


def _ngram_pipeline(spec: SpecOptions, options: NgramOptions) -> Pipeline:
    return get_pipeline(
        "ngram",
        num_draft_tokens=spec.num_draft_tokens or 8,
        max_depth=options.max_depth,
        min_match=options.min_match,
        min_breadth=options.min_breadth,
        max_breadth=options.max_breadth,
        order=options.order,
        max_occurrences=options.max_occurrences,
        flush_tokens=options.flush_tokens,
        corpus=None if options.corpus is None else load_corpus(options.corpus),
        matcher=options.matcher,
    )


def _ngram_store(algorithm: str, options: NgramOptions | None) -> Cell | None:
    """The shared n-gram store of an ngram engine (None when switched off or not ngram)."""
    options = options or NgramOptions()
    if algorithm != "ngram" or options.store_size == 0:
        return None
    return Cell(new_store(options.store_size))


def _check_limits(target: DecoderModel, config: EngineConfig) -> None:
    """Refuse limits the target cannot run (their values alone are checked by EngineConfig)."""
    context = config.max_context
    model_limit = target.config.max_position_embeddings
    if context > model_limit:
        raise ValueError(
            f"max_context={context} exceeds the model's max_position_embeddings={model_limit}"
        )


def _pipeline(
    algorithm: str,
    target: DecoderModel,
    draft: Any,
    spec: SpecOptions,
    ngram: NgramOptions | None = None,
    steps: int = 1,
) -> Pipeline:
    """The pipeline value of ``algorithm`` (``steps``: plain decoding's steps per round)."""
    if algorithm == "plain":
        return get_pipeline(algorithm, num_steps=steps)
    if algorithm == "ngram":
        return _ngram_pipeline(spec, ngram or NgramOptions())
    if algorithm not in SPECULATIVE:
        return get_pipeline(algorithm)
    if draft is None:
        raise ValueError(f"algorithm {algorithm!r} needs a draft model; pass --draft DIR")
    if algorithm in BLOCK:
        return get_pipeline(
            algorithm,
            block_size=spec.block_size or draft.config.block_size,
            sample_drafts=spec.sample_drafts,
            budget=spec.verify_budget,
            cost_table=spec.cost_table,
            min_verify=spec.min_verify,
            packed_verify=spec.packed_verify,
        )
    # Multi-layer EAGLE alone has the chain_hidden option.
    extra = {"chain_hidden": spec.chain_hidden} if algorithm == "multi_layer_eagle" else {}
    return get_pipeline(
        algorithm,
        num_steps=spec.num_steps,
        topk=spec.topk,
        num_draft_tokens=spec.num_draft_tokens,
        sample_drafts=spec.sample_drafts,
        vocab_size=draft.draft_vocab_size,  # topk cannot exceed what the draft can propose
        **extra,
    )


def decode_steps(algorithm: str, spec: SpecOptions, device: torch.device) -> int:
    """The plain steps per round an engine runs: ``spec.decode_steps``, or by default 1 on the
    CPU and :data:`GPU_DECODE_STEPS` on CUDA for plain decoding (1 for every other algorithm,
    whose rounds are their own). More than 1 is refused for algorithms other than plain."""
    steps = spec.decode_steps
    if steps is not None and steps > 1 and algorithm != "plain":
        raise ValueError(
            f"decode_steps={steps} runs several plain decoding steps per launch, which only "
            f"algorithm='plain' does; {algorithm!r} rounds have their own shape. Drop "
            "decode_steps (--decode-steps) or use algorithm='plain' (adaptive speculation's "
            "depth 0 already runs several plain steps per round)"
        )
    if steps is not None:
        return steps
    return GPU_DECODE_STEPS if algorithm == "plain" and device.type == "cuda" else 1


def _device_of(model: Any) -> torch.device:
    """The device a model's weights live on (the CPU for one without parameters)."""
    weight = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    return torch.device("cpu") if weight is None else weight.device


def _adaptive_variants(algorithm: str, draft: Any, spec: SpecOptions) -> tuple[Pipeline, ...]:
    """The pipeline values adaptive speculation chooses among (none without adaptive_steps)."""
    if not spec.adaptive_steps:
        return ()
    if algorithm not in ADAPTIVE:
        raise ValueError(
            f"adaptive speculation switches between draft depths over one EAGLE-family state; "
            f"it supports {', '.join(sorted(ADAPTIVE))}, not {algorithm!r}: drop adaptive_steps "
            "or choose one of those algorithms"
        )
    if spec.topk != 1 or spec.num_draft_tokens is not None:
        raise ValueError(
            f"adaptive speculation varies the length of a chain: use topk=1 (got {spec.topk}) "
            f"and leave num_draft_tokens unset (got {spec.num_draft_tokens}); a chain of n "
            "draft tokens verifies n + 1"
        )
    if draft is None:
        raise ValueError(f"algorithm {algorithm!r} needs a draft model; pass --draft DIR")
    return adaptive.eagle_variants(
        spec.adaptive_steps, sample_drafts=spec.sample_drafts, vocab_size=draft.draft_vocab_size
    )


def _with_controls(pipeline: Pipeline, config: EngineConfig, spec: SpecOptions) -> Pipeline:
    """``pipeline`` counting what its rounds emit for the requests' penalties
    (``pipelines.base.counting``) when the engine applies penalties, and with its drafts
    unmasked by the requests' grammars (``pipelines.base.free_drafts``) when
    ``spec.grammar_drafts`` is ``"free"``; each adaptive variant is wrapped on its own, inside
    its captured graph."""
    if spec.grammar_drafts == "free":
        pipeline = free_drafts(pipeline)
    return counting(pipeline) if config.penalties else pipeline


def _graphed(pipeline: Pipeline, config: EngineConfig, device: torch.device) -> Pipeline:
    """``pipeline`` with its decoding round captured per batch bucket, where that applies: on
    CUDA, with graphs switched on; a round with host work between stages has its device part
    (``Pipeline.device_round``, when it names one) captured instead. With
    ``config.compile_stages``, that round is compiled first (``runtime.compiled``), and, where
    it is not captured, run padded to its bucket (``CompiledDecode``)."""
    graphs = device.type == "cuda" and config.cuda_graphs
    if not graphs and not config.compile_stages:
        return pipeline
    if pipeline.host_work and pipeline.device_round is None:
        return pipeline
    if config.max_batch > max(config.graph_buckets):
        raise ValueError(
            f"max_batch={config.max_batch} exceeds the largest CUDA-graph bucket "
            f"{max(config.graph_buckets)}: add a larger bucket to graph_buckets, lower max_batch, "
            "or pass cuda_graphs=False"
        )

    def wrapped(round_fn: Callable[..., Any]) -> Callable[..., Any]:
        if not config.compile_stages:
            return GraphedDecode(round_fn, config.graph_buckets)
        compiled = compile_round(round_fn, config.compile_stages)
        if graphs:
            return GraphedDecode(compiled, config.graph_buckets)
        return CompiledDecode(round_fn, compiled, config.graph_buckets)

    if pipeline.host_work:
        return attrs.evolve(
            pipeline,
            decode=functools.partial(pipeline.decode, device_round=wrapped(pipeline.device_round)),
        )
    return attrs.evolve(pipeline, decode=wrapped(pipeline.decode))


def _allocate(what: str, fix: str, build: Callable[[], T]) -> T:
    """``build()``, with running out of GPU memory reported as what did not fit and the fix."""
    try:
        return build()
    except torch.cuda.OutOfMemoryError as error:
        free, total = torch.cuda.mem_get_info()
        raise MemoryError(
            f"{what} does not fit in GPU memory ({free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB): {fix}"
        ) from error


def engine_from_model(
    target: DecoderModel,
    *,
    algorithm: str = "plain",
    draft: Any = None,
    spec: SpecOptions | None = None,
    tokenizer: Tokenizer | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch: int = 16,
    max_context: int | None = None,
    prefill_budget: int = 512,
    ngram: NgramOptions | None = None,
    cuda_graphs: bool = True,
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    fuse_projections: bool = True,
    overlap: bool = False,
    max_logprobs: int = 0,
    logit_bias: bool = False,
    penalties: bool = False,
    prefix_cache: bool = True,
    compile_stages: tuple[str, ...] = (),
    free_window_pages: bool = True,
    mla_kernel: str = "triton",
    half_gemv: tuple[str, ...] = (),
) -> Engine:
    """An engine over an already-built target model (and draft head, for speculative algorithms).

    ``max_context`` defaults to the model's ``max_position_embeddings`` (capped at 4096 to keep
    CPU pools small); ``num_pages`` defaults to enough pages for ``max_batch`` full contexts.
    ``ngram`` configures ``algorithm="ngram"`` (ignored otherwise). On CUDA, each decoding round
    runs as a CUDA graph captured per batch bucket (``graph_buckets``; ``max_batch`` may not
    exceed the largest) unless ``cuda_graphs`` is False or the pipeline has host work (the host
    n-gram matcher: then its device part is captured);
    with ``spec.adaptive_steps``, each variant's rounds are captured separately. ``overlap``
    makes the scheduler prepare each step while the device runs the previous one.
    ``max_logprobs`` bounds the top alternatives a request may ask for, ``logit_bias`` lets
    requests carry a logit bias, ``penalties`` penalties and ``min_tokens``, ``prefix_cache``
    lets requests reuse cached prompt prefixes, ``free_window_pages`` returns pages outside
    a sliding window to the pool, ``compile_stages`` compiles parts of each decoding round
    with ``torch.compile``, ``mla_kernel`` picks a DeepSeek target's latent-attention kernel
    in decoding rounds (:class:`EngineConfig`).
    ``fuse_projections`` fuses the target's and the draft's projections in place (values
    unchanged; see ``models.decoder.fuse_projections_``). ``half_gemv`` sets, in place, which
    of the target's and the draft's float projections run the Triton matrix-vector kernel at
    decode rows (``models.decoder.gemv_projections_``; empty: none).

    Every limit is checked before anything is built or fused (:class:`EngineConfig`; a
    ``num_pages`` of at least 2, page 0 being the padding page); ``None`` is the default of
    ``num_pages`` and ``max_context``, never 0. ``spec`` and ``ngram`` are records, checked
    when they were built.
    """
    config = _engine_config(
        page_size=page_size,
        num_pages=num_pages,
        max_batch=max_batch,
        max_context=min(target.config.max_position_embeddings, 4096)
        if max_context is None
        else max_context,
        prefill_budget=prefill_budget,
        cuda_graphs=cuda_graphs,
        graph_buckets=graph_buckets,
        fuse_projections=fuse_projections,
        overlap=overlap,
        max_logprobs=max_logprobs,
        logit_bias=logit_bias,
        penalties=penalties,
        prefix_cache=prefix_cache,
        compile_stages=compile_stages,
        free_window_pages=free_window_pages,
        mla_kernel=mla_kernel,
        half_gemv=half_gemv,
    )
    _check_limits(target, config)
    _check_hybrid(target, algorithm)
    spec = SpecOptions() if spec is None else checks.instance("spec", spec, kind=SpecOptions)
    if ngram is not None:
        checks.instance("ngram", ngram, kind=NgramOptions)
    steps = decode_steps(algorithm, spec, _device_of(target))
    variants = tuple(
        _with_controls(v, config, spec) for v in _adaptive_variants(algorithm, draft, spec)
    )
    if variants and getattr(target, "tp", SINGLE).size > 1:
        raise ValueError(
            "adaptive speculation picks each round's depth from this process's own timings, so "
            "the ranks of a tensor-parallel group could pick different depths and diverge: drop "
            "adaptive_steps (--adaptive-steps) or run with tp=1"
        )
    check_mla_kernel(
        config.mla_kernel,
        target,
        overlap=config.overlap,
        compile_stages=config.compile_stages,
        adaptive=bool(variants),
    )
    forwards = (
        round_forwards(
            algorithm,
            steps=steps,
            num_steps=spec.num_steps,
            topk=spec.topk,
            num_draft_tokens=spec.num_draft_tokens,
        )
        if config.mla_kernel == "flashinfer"
        else ()
    )
    policy = spec.adaptive_policy
    # eagle_variants orders the chains by depth; their acceptance is pooled across depths.
    depths = tuple(sorted(spec.adaptive_steps)) if variants else None
    pipeline = (
        adaptive.pipeline(variants, policy=policy, depths=depths)
        if variants
        else _with_controls(_pipeline(algorithm, target, draft, spec, ngram, steps), config, spec)
    )
    for model in (target, draft):
        if isinstance(model, torch.nn.Module):
            if config.fuse_projections:
                fuse_projections_(model)
            gemv_projections_(model, config.half_gemv)
    if config.num_pages == 0:  # not given: room for max_batch full contexts
        per_request = config.max_pages_per_request(reserved_lookahead(pipeline, config.overlap))
        config = attrs.evolve(config, num_pages=config.max_batch * per_request + 1)
    fix = "lower max_batch, max_context or num_pages"
    # A hybrid model's recurrent slots: one per request, each keeping more states than a
    # round (and, overlapped, the round in flight) writes past the committed prefix.
    states = {
        "state_slots": config.max_batch + 1,
        "state_ring": reserved_lookahead(pipeline, config.overlap) + 1,
    }
    resources = Resources(
        target=target,
        target_pool=_allocate(
            f"the target's KV pool of {config.num_pages} pages",
            fix,
            lambda: target.new_pool(config.num_pages, config.page_size, **_hybrid(target, states)),
        ),
        draft=draft,
        draft_pool=None
        if draft is None
        else _allocate(
            f"the draft's KV pool of {config.num_pages} pages",
            fix,
            lambda: draft.new_pool(config.num_pages, config.page_size, **_hybrid(draft, states)),
        ),
        ngram_store=_ngram_store(algorithm, ngram),
        goodput=Cell(adaptive.new_measurements(policy, len(variants))) if variants else None,
    )
    if forwards:
        pool = with_latent_plans(
            resources.target_pool,
            target,
            forwards,
            stride=config.max_pages_per_request(reserved_lookahead(pipeline, config.overlap)),
            max_rows=max(config.max_batch, *config.graph_buckets),
        )
        resources = attrs.evolve(resources, target_pool=pool)
    device = resources.target_pool.k.device
    # Each variant is captured on its own: its graphs and buffers are its own, never shared.
    graphed = [_graphed(v, config, device) for v in variants]
    return Engine(
        pipeline=adaptive.pipeline(graphed, policy=policy, depths=depths)
        if variants
        else _graphed(pipeline, config, device),
        resources=resources,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=target.config.eos_token_ids,
    )


#: Algorithms refused on a Mamba-2 hybrid target (Nemotron-H): its MTP layers (mtp, nextn,
#: multi_layer_eagle) are not built, and its attention layers cache keys without rotary
#: embedding, which a frozen-KV draft's rotated queries cannot read as trained; see
#: docs/hybrid.md. Every algorithm runs on a gated-DeltaNet hybrid (Qwen3-Next).
MAMBA_HYBRID_REFUSED = frozenset({"mtp", "nextn", "multi_layer_eagle", "frozen_kv_mtp"})


def _check_hybrid(target: Any, algorithm: str) -> None:
    """Refuse what a hybrid target cannot run yet, naming the reason (before anything is
    built)."""
    config = getattr(target, "config", None)
    if not getattr(config, "is_hybrid", False):
        return
    if config.mamba is not None and algorithm in MAMBA_HYBRID_REFUSED:
        raise UnsupportedModel(
            f"algorithm={algorithm!r} is not supported on the Mamba-2 hybrid target "
            f"{config.architecture}: its MTP layers (mtp, nextn, multi_layer_eagle) are not "
            "built, and its attention caches keys without rotary embedding, which a frozen-KV "
            "draft's rotated queries do not read. Use eagle, eagle3, standalone, dflash, "
            "dspark, ngram or plain"
        )
    if getattr(target, "tp", SINGLE).size > 1:
        raise UnsupportedModel(
            f"tensor parallelism is not supported for the hybrid target {config.architecture}: "
            "its recurrent states are not sharded; load it with tp=1"
        )


def _hybrid(model: Any, states: dict[str, int]) -> dict[str, int]:
    """``states`` (the recurrent pool's sizes) for a model with recurrent layers (a
    hybrid target, or a standalone draft that is one), else nothing: other models' pools take
    no such sizes."""
    decoder = model.model if isinstance(model, StandaloneHead) else model
    hybrid = isinstance(decoder, DecoderModel) and decoder.config.is_hybrid
    return states if hybrid else {}


def _engine_config(*, num_pages: object = None, **limits: Any) -> EngineConfig:
    """The checked limits :func:`engine_from_model` is given, as a config; ``num_pages`` None
    (0 in the config) leaves the pool to be sized for ``max_batch`` full contexts."""
    if num_pages is not None:
        checks.integer(
            "num_pages", num_pages, minimum=2, fix="page 0 is padding; give at least 2 or None"
        )
    return EngineConfig(num_pages=0 if num_pages is None else num_pages, **limits)


def _draft_sharding(tp: TensorParallel, draft_tp: int | None) -> TensorParallel:
    """The group a draft is sharded over: the target's (``draft_tp`` None or ``tp.size``), or
    none (``draft_tp == 1``: a whole draft on every rank)."""
    if draft_tp is None or draft_tp == tp.size:
        return tp
    if draft_tp == 1:
        return SINGLE
    raise ValueError(
        f"draft_tp={draft_tp} with tp={tp.size}: the draft is either sharded with the target "
        f"(draft_tp={tp.size}) or whole on every rank (draft_tp=1)"
    )


def build_engine(
    model: str | Path,
    *,
    algorithm: str = "plain",
    draft: str | Path | None = None,
    spec: SpecOptions | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    ngram: NgramOptions | None = None,
    tp: TensorParallel = SINGLE,
    draft_tp: int | None = None,
    **limits: Any,
) -> Engine:
    """Load a Hugging Face model folder (and its tokenizer, when it has one) into an engine.

    Speculative algorithms load their draft head from ``draft`` (MTP/NEXTN layers default to
    the target's own folder). With a tensor-parallel group ``tp`` (``runtime.distributed``),
    the target is this rank's shard and each rank reads only its part of the checkpoint; the
    draft is sharded with it, or whole on every rank with ``draft_tp=1`` (vLLM's
    ``draft_tensor_parallel_size``; a frozen-KV draft must be sharded).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    # The limits are refused before the model loads (engine_from_model checks them against it).
    _engine_config(**{k: v for k, v in limits.items() if k != "max_context" or v is not None})
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available here")
    get_pipeline("plain" if algorithm in SPECULATIVE else algorithm)  # unknown names fail early
    if algorithm in ("mtp", "nextn", "multi_layer_eagle") and draft is None:
        draft = model
    if algorithm in SPECULATIVE and draft is None:
        raise ValueError(f"algorithm {algorithm!r} needs a draft model; pass --draft DIR")
    torch_dtype = DTYPES[dtype] if dtype else None
    draft_group = _draft_sharding(tp, draft_tp)
    fix = "choose a smaller model, dtype='bfloat16', or a device with more memory"
    target = _allocate(
        f"the target model {model}",
        fix,
        lambda: load_model(model, dtype=torch_dtype, device=device, tp=tp),
    )
    _check_hybrid(target, algorithm)  # before the draft loads: its loader would fail less clearly
    head = None
    if algorithm in SPECULATIVE:
        loaders = {
            "standalone": load_standalone,
            "frozen_kv_mtp": load_frozen_kv,
            "multi_layer_eagle": load_multi_layer,
            "dflash": load_block_draft,
            "dspark": load_block_draft,
        }
        load = loaders.get(algorithm, load_draft)
        head = _allocate(
            f"the draft {draft}",
            fix,
            lambda: load(
                draft, target, algorithm, dtype=torch_dtype, device=device, tp=draft_group
            ),
        )
    folder = Path(model)
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").exists() else None
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=head,
        spec=spec,
        tokenizer=tokenizer,
        ngram=ngram,
        **limits,
    )
