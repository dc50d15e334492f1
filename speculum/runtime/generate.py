"""``generate``: the simple Python entry point, built on the reference scheduler."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from speculum.models.draft_kind import draft_algorithm
from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.runtime import checks, distributed, scheduler
from speculum.runtime.default_model import (
    DEFAULT_ALGORITHM,
    default_draft_dir,
    default_model_dir,
)
from speculum.runtime.engine import Engine, NgramOptions, SpecOptions, build_engine

__all__ = [
    "Comparison",
    "Generation",
    "acceptance_stats",
    "compare_plain",
    "completion_seed",
    "engine_for",
    "generate",
    "run_to_completion",
]


@attrs.define(frozen=True, slots=True, kw_only=True)
class Generation:
    """One prompt's result: generated ids (prompt excluded), their text, and statistics.

    ``stats`` holds ``num_forward_steps`` (target forwards that involved the request: prefill
    chunks plus decoding rounds), ``num_rounds`` (decoding rounds), ``accept_length_mean``
    (tokens emitted per decoding round, bonus token included; 1.0 for plain decoding),
    ``tokens_per_second``, the scheduler's ``host_ms_per_step``, ``hidden_host_ms_per_step``
    and ``blocked_ms_per_step`` (``scheduler.host_stats``, over the whole call) and
    ``finish_reason``, ``cached_tokens`` (prompt tokens whose KV came from the prefix cache,
    their prefill skipped); a ``length`` finish adds ``length_limit``: ``max_new_tokens``, or
    ``max_context`` (with ``max_context``, the engine's) when the prompt and the budget did not
    fit the context, which cut the budget short. A prompt the engine could not decode (its
    logits turned NaN, say) ends with ``finish_reason == "error"``, the tokens decoded before
    that, and ``error`` saying why; the other prompts are unaffected.

    ``logprobs`` (``None`` unless asked for) holds one entry per generated token:
    ``{"token_id": int, "logprob": float, "top_logprobs": [{"token_id": int, "logprob":
    float}, ...]}``, the token's log-probability under the target's distribution that decided
    it and that distribution's most likely tokens, most likely first
    (``scheduler.Sampling.logprobs``, ``docs/request_controls.md``). ``prompt_logprobs``
    (``None`` unless asked for) holds one per prompt token: ``None`` for the first, then
    entries of the same shape, each token's log-probability given the tokens before it under
    the target's raw distribution (``scheduler.Sampling.prompt_logprobs``).
    """

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str
    stats: dict[str, float | int | str]
    error: str | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None


def run_to_completion(
    engine: Engine,
    state: scheduler.SchedulerState,
    on_output: Callable[[scheduler.RequestOutput], None] | None = None,
) -> tuple[scheduler.SchedulerState, dict[int, scheduler.Request]]:
    """Step until every request has finished; returns the final state and finished requests.
    ``on_output`` sees each step's output of each request as it comes."""
    finished: dict[int, scheduler.Request] = {}
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(engine, state)
        for output in outputs if on_output else ():
            on_output(output)
        finished.update((o.rid, o.request) for o in outputs if o.finished)
    return state, finished


@attrs.define
class IncrementalText:
    """The text of a growing list of token ids, decoded a few tokens at a time: what
    ``tokenizer.decode(ids)`` gives, without decoding every id again at each step (which cost
    time growing with the output, per request and step, for every streamed request).

    ``settled`` is the text of ``ids[:read]``, which ended on a whole character; the tokens
    after ``read`` are decoded together with those from ``start`` (the previous settled
    stretch), and the text they add is the difference, so that what a tokenizer decodes
    differently at the start of a call (a leading space, a character cut in its bytes) is the
    same on both sides of it.
    """

    ids: list[int] = attrs.Factory(list)
    settled: str = ""
    start: int = 0
    read: int = 0

    def extend(self, tokenizer: Any, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; the text of all the ids so far."""
        self.ids.extend(new_ids)
        context = tokenizer.decode(self.ids[self.start : self.read])
        text = tokenizer.decode(self.ids[self.start :])
        if not text.startswith(context):  # a tokenizer that does not decode piecewise here
            return tokenizer.decode(self.ids)
        added = text[len(context) :]
        if added and not added.endswith("\ufffd"):  # ends on a whole character
            self.settled += added
            self.start, self.read = self.read, len(self.ids)
            return self.settled
        return self.settled + added


class _TextStream:
    """Turns each step's new token ids of one batch into the text they complete, for
    ``generate``'s ``on_tokens``: a tail that decodes to a replacement character (a multi-byte
    character cut between tokens) waits for the next tokens, or for the request's end."""

    def __init__(
        self,
        engine: Engine,
        on_tokens: Callable[[int, tuple[int, ...], str], None],
        rids: Sequence[int],
    ) -> None:
        self.engine, self.on_tokens = engine, on_tokens
        self.index = {rid: i for i, rid in enumerate(rids)}  # request id -> prompt index
        self.texts: dict[int, IncrementalText] = {}
        self.shown: dict[int, str] = {}

    def __call__(self, output: scheduler.RequestOutput) -> None:
        """Hand ``output``'s new ids and newly completed text to ``on_tokens``."""
        rid, tokenizer = output.rid, self.engine.tokenizer
        new = ""
        if tokenizer is not None:
            decoded = self.texts.setdefault(rid, IncrementalText())
            text = decoded.extend(tokenizer, output.new_token_ids)
            shown = self.shown.get(rid, "")
            text = _shown_text(text, output.request)  # a stop string is never shown
            complete = output.finished or not text.endswith("\ufffd")
            if complete and text.startswith(shown):
                new, self.shown[rid] = text[len(shown) :], text
        if output.new_token_ids or new:
            self.on_tokens(self.index[rid], output.new_token_ids, new)


def generate(
    prompts: str | Sequence[str | Sequence[int] | Mapping[str, Any]],
    *,
    model: str | Path | None = None,
    engine: Engine | None = None,
    algorithm: str | None = None,
    draft: str | Path | None = None,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    sample_drafts: bool = False,
    chain_hidden: bool = True,
    adaptive_steps: Sequence[int] = (),
    adaptive_margin: float = 0.05,
    block_size: int | None = None,
    verify_budget: str | int = "all",
    cost_table: tuple[tuple[int, float], ...] | None = None,
    min_verify: int = 0,
    packed_verify: bool = True,
    grammar_drafts: str = "masked",
    decode_steps: int | None = None,
    ngram: NgramOptions | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    logprobs: int = 0,
    prompt_logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    json_schema: str | Mapping[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    n: int = 1,
    stop_token_ids: int | Sequence[int] = (),
    stop_strings: str | Sequence[str] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    max_context: int | None = None,
    max_batch: int = 16,
    page_size: int = 16,
    device: str = "cpu",
    dtype: str | None = None,
    cuda_graphs: bool = True,
    compile_stages: Sequence[str] = (),
    half_gemv: Sequence[str] = (),
    overlap: bool = False,
    prefix_cache: bool = True,
    mla_kernel: str = "triton",
    tp: int = 1,
    draft_tp: int | None = None,
    speculative_config: Mapping[str, Any] | None = None,
    on_tokens: Callable[[int, tuple[int, ...], str], None] | None = None,
) -> list[Generation]:
    """Generate a completion for each prompt (text, a list of token ids, or a mapping that
    gives one of those as ``prompt`` or ``prompt_ids`` with settings of its own among
    :data:`REQUEST_SETTINGS`, e.g. ``{"prompt": "def f(x):", "temperature": 0.7}``).

    With neither ``model`` nor ``engine``, the bundled default model runs, by default with its
    EAGLE-3 draft. ``algorithm`` None means the kind of ``draft`` when one is given (read from
    its folder: a draft is never ignored), else that default, or plain decoding for any other
    model. All prompts are decoded together by the continuous-batching scheduler; each result
    is what that prompt yields alone.

    Speculative algorithms take their draft from ``draft`` and the round's shape from
    ``num_steps``, ``topk`` and ``num_draft_tokens`` (tree nodes, root included);
    ``sample_drafts`` samples drafts instead of taking the draft's top-k; ``chain_hidden``
    chains multi-layer EAGLE's MTP layers. ``adaptive_steps`` (e.g. ``(0, 1, 3, 5)``) replaces
    ``num_steps`` with several chain depths, 0 meaning no speculation, and each round runs the
    one with the best measured goodput at the batch's size (within ``adaptive_margin`` of the
    best, variants keep being sampled; see ``docs/adaptive.md``). Block drafters (``dflash``,
    ``dspark``) take ``block_size`` (default: the draft's) and the verify budget
    ``verify_budget``, ``cost_table``, ``min_verify`` and ``packed_verify`` (``SpecOptions``).
    ``grammar_drafts`` (``"masked"`` or ``"free"``, ``SpecOptions``) says whether a request's
    grammar masks the drafts as well as the target.
    ``algorithm="ngram"`` needs no draft; ``ngram`` holds its options. Plain decoding runs
    ``decode_steps`` steps per launch (default 1 on the CPU, ``engine.GPU_DECODE_STEPS`` on
    CUDA; the same tokens whatever it is). vLLM's
    ``speculative_config`` dict is accepted too (:data:`SPECULATIVE_CONFIG_KEYS`: ``method``,
    ``model``, ``num_speculative_tokens``, ``draft_tensor_parallel_size``,
    ``prompt_lookup_max``, ``prompt_lookup_min``) in place of those arguments.

    Sampling: ``temperature`` (0 is greedy), ``top_k``, ``top_p``, ``min_p`` and ``seed``;
    ``logit_bias`` ``{token_id: bias}`` adds each bias (in [-100, 100]) to the target's logit of
    that token before all of them (an engine built here allows it when asked; one given must
    have been built with ``logit_bias=True``). ``repetition_penalty`` (> 0, 1 is off: over the
    prompt and the output), ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 is
    off: over the output) penalize repeated tokens, and ``min_tokens`` (at most
    ``max_new_tokens``) keeps EOS, ``stop_token_ids`` and ``stop_strings`` from ending a
    request before it has generated that many tokens (vLLM's ``SamplingParams``; an engine
    built here applies them when asked; one given must have been built with
    ``penalties=True``). ``json_schema`` (JSON text or a dict), ``regex`` or ``grammar``
    (xgrammar's EBNF), at most one, constrain the output to that language: every
    distribution that decides a token, at every tree node, is masked to the tokens the
    grammar allows after the output and the node's path, so every pipeline emits plain
    constrained decoding's tokens, overlapped or not (``docs/request_controls.md``; needs
    ``pip install 'speculum[grammar]'``). ``n`` (an int >= 1) asks
    for ``n`` completions of every prompt: the results then hold ``n`` per prompt, prompt
    after prompt (completion ``j`` of prompt ``i`` at ``i * n + j``), each decoded with its
    own random streams, seeded by :func:`completion_seed` from the prompt's seed (the first
    completion keeps it), so a call always returns the same completions; greedy completions
    are all alike. Each completion is a request of its own and prefills its own copy of the
    prompt (no sharing yet).
    A request stops at ``max_new_tokens``, at the end of the context, at EOS (unless
    ``ignore_eos``) or at any of ``stop_token_ids`` or ``stop_strings`` (each a single id or
    string, or a sequence of them). A stop string ends the request at the token that completes
    it (tokens after it, even of the same round, are discarded); the result's ``text`` ends
    before the stop string, as vLLM's does, unless ``include_stop_str_in_output``, while
    ``token_ids`` holds every token emitted, the one that completed the stop string included
    (vLLM's ``token_ids`` too). ``logprobs`` N > 0 returns each generated token's
    log-probability and its N most likely alternatives (``Generation.logprobs``); an engine
    built here computes N, one given must have been built with ``max_logprobs >= N``.
    ``prompt_logprobs`` N (None: off) returns each prompt token's log-probability given the
    tokens before it and the N most likely tokens there (``Generation.prompt_logprobs``; such
    a prompt is prefilled in full, never from the prefix cache).
    ``max_context``, ``max_batch`` and ``page_size`` size the
    engine (``engine_from_model``). On CUDA, decoding rounds run as CUDA graphs unless
    ``cuda_graphs`` is False; ``compile_stages`` compiles parts of each round with
    ``torch.compile`` (``EngineConfig.compile_stages``, ``docs/gpu.md``); ``mla_kernel``
    picks a DeepSeek target's latent-attention kernel in decoding rounds, ``"triton"`` or
    ``"flashinfer"`` (``EngineConfig.mla_kernel``, ``docs/mla.md``); ``half_gemv`` names
    the projections whose decode-sized matmuls run the Triton matrix-vector kernel
    (``EngineConfig.half_gemv``). ``overlap`` makes the scheduler prepare each step while
    the device runs the previous one (same tokens; see ``docs/overlap.md``). ``prefix_cache``
    (on by default) lets a prompt reuse the KV pages of the prompt prefixes earlier prompts
    computed, in this call and, with an ``engine`` given, in earlier calls on it (same
    tokens; ``stats["cached_tokens"]`` counts the prompt tokens reused;
    ``docs/prefix_cache.md``).

    Streaming: ``on_tokens(i, token_ids, text)`` is called as tokens come, after each step
    that emitted some for result ``i`` (prompt ``i`` when ``n`` is 1), with the new ids and
    the text they complete (``""`` while a multi-byte character is cut between tokens, or
    without a tokenizer); the pieces add up to each result's ``token_ids`` and ``text``.

    ``tp > 1`` shards the model over ``tp`` processes (tensor parallelism; ``draft_tp=1``
    keeps the draft whole on every rank): inside a group started by torchrun, this process is
    one rank; otherwise ``tp`` worker processes are started, each runs this call (so
    ``on_tokens`` must be picklable, and runs there), and rank 0's result is returned. Every
    rank decodes rank 0's requests and returns the same results.
    """
    arguments = dict(locals())  # this call's arguments, for the worker processes to repeat
    if speculative_config is not None:
        return generate(**_with_speculative_config(arguments))
    # Checked here, before any model loads or worker starts (scheduler.Sampling).
    scheduler.Sampling(**{name: arguments[name] for name in _SAMPLING})
    checks.integer("n", n, minimum=1, fix="n is how many completions each prompt gets")
    if engine is None and tp > 1 and not distributed.launched():
        del arguments["engine"]
        return distributed.launch(functools.partial(generate, **arguments), tp)
    if engine is None:
        engine = _engine(arguments)
    batch = [prompts] if isinstance(prompts, str) else list(prompts)
    shared_settings = {name: arguments[name] for name in REQUEST_SETTINGS}
    # Every rank must schedule the same requests for the ranks' collectives to pair up: rank 0's.
    requests = engine.tp.from_leader([_request(engine, p, shared_settings) for p in batch])
    state, rids = scheduler.new_state(engine), []
    for prompt, settings in requests:
        seed = settings["sampling"].seed
        for index in range(n):
            sampling = attrs.evolve(settings["sampling"], seed=completion_seed(seed, index))
            state, rid = scheduler.add_request(
                engine, state, prompt, **{**settings, "sampling": sampling}
            )
            rids.append(rid)
    stream = None if on_tokens is None else _TextStream(engine, on_tokens, rids)
    start = time.perf_counter()
    final, finished = run_to_completion(engine, state, stream)
    elapsed = time.perf_counter() - start
    total = sum(len(r.output) for r in finished.values())
    shared = {"tokens_per_second": total / max(elapsed, 1e-9), **scheduler.host_stats(final)}
    return [_result(engine, finished[rid], shared) for rid in rids]


_MASK64 = 2**64 - 1


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a prompt seeded ``seed`` (``generate``'s ``n``):
    ``seed`` itself for completion 0, so ``n=1`` changes nothing; for the others, SplitMix64's
    finaliser of ``seed + index * 0x9E3779B97F4A7C15`` (mod 2**64), as a signed 64-bit int.
    Completions 1, 2, ... get distinct seeds (the finaliser is a bijection and so is the sum),
    unrelated to each other and to nearby prompts' seeds (``seed + 1`` would reuse one)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def engine_for(
    *, max_logprobs: int = 0, logit_bias: bool = False, penalties: bool = False, **options: Any
) -> Engine:
    """The engine ``generate(prompts, **options)`` would build, for callers that keep one
    engine for many requests (``speculum serve``): ``options`` are ``generate``'s arguments
    that shape the engine (``model``, ``algorithm``, ``draft``, ``num_steps``, ...,
    ``max_batch``, ``device``; the bundled default pair without ``model``). It computes up to
    ``max_logprobs`` alternatives per token, applies logit biases when ``logit_bias`` and
    penalties (and ``min_tokens``) when ``penalties``."""
    defaults = {n: p.default for n, p in inspect.signature(generate).parameters.items()}
    not_engine = {"prompts", "engine", "on_tokens", "speculative_config", *REQUEST_SETTINGS}
    unknown = sorted(set(options) - (set(defaults) - not_engine))
    if unknown:
        raise TypeError(
            f"engine_for got arguments {unknown} that do not shape an engine; it takes "
            f"{', '.join(sorted(set(defaults) - not_engine))}"
        )
    arguments = {**defaults, **options}
    return _engine(arguments, max_logprobs=max_logprobs, logit_bias=logit_bias, penalties=penalties)


def _engine(
    arguments: dict[str, Any],
    max_logprobs: int | None = None,
    logit_bias: bool | None = None,
    penalties: bool | None = None,
) -> Engine:
    """The engine ``generate``'s ``arguments`` describe (see its docstring for the defaults);
    ``max_logprobs``, ``logit_bias`` and ``penalties`` default to what the arguments ask for."""
    a = arguments
    algorithm, draft, model = a["algorithm"], a["draft"], a["model"]
    algorithm = algorithm and algorithm.lower()  # EAGLE3 as SGLang spells it is eagle3
    if algorithm is None and draft is not None:
        algorithm = draft_algorithm(draft)  # a draft is never ignored
    if model is None:
        model = default_model_dir()
        if algorithm in (None, DEFAULT_ALGORITHM) and draft is None:
            algorithm, draft = DEFAULT_ALGORITHM, default_draft_dir()
    return build_engine(
        model,
        algorithm=algorithm or "plain",
        draft=draft,
        spec=SpecOptions(
            num_steps=a["num_steps"],
            topk=a["topk"],
            num_draft_tokens=a["num_draft_tokens"],
            sample_drafts=a["sample_drafts"],
            chain_hidden=a["chain_hidden"],
            adaptive_steps=a["adaptive_steps"],
            adaptive_policy=AdaptivePolicy(margin=a["adaptive_margin"]),
            block_size=a["block_size"],
            verify_budget=a["verify_budget"],
            cost_table=a["cost_table"],
            min_verify=a["min_verify"],
            packed_verify=a["packed_verify"],
            grammar_drafts=a["grammar_drafts"],
            decode_steps=a["decode_steps"],
        ),
        device=a["device"],
        dtype=a["dtype"],
        ngram=a["ngram"],
        cuda_graphs=a["cuda_graphs"],
        compile_stages=tuple(a["compile_stages"]),
        half_gemv=tuple(a["half_gemv"]),
        overlap=a["overlap"],
        prefix_cache=a["prefix_cache"],
        mla_kernel=a["mla_kernel"],
        tp=distributed.tensor_parallel(a["tp"], a["device"]),
        draft_tp=a["draft_tp"],
        max_context=a["max_context"],
        max_batch=a["max_batch"],
        page_size=a["page_size"],
        max_logprobs=a["logprobs"] if max_logprobs is None else max_logprobs,
        logit_bias=_asks_for_logit_bias(a) if logit_bias is None else logit_bias,
        penalties=_asks_for_penalties(a) if penalties is None else penalties,
    )


def _own_settings(arguments: dict[str, Any]) -> list[Mapping[str, Any]]:
    """The prompts of ``generate``'s call given as mappings: those with settings of their own."""
    prompts = arguments["prompts"]
    return [] if isinstance(prompts, str) else [p for p in prompts if isinstance(p, Mapping)]


def _asks_for_logit_bias(arguments: dict[str, Any]) -> bool:
    """Whether ``generate``'s call gives a logit bias, shared or a mapping prompt's own."""
    own = _own_settings(arguments)
    return bool(arguments["logit_bias"]) or any(p.get("logit_bias") for p in own)


def _asks_for_penalties(arguments: dict[str, Any]) -> bool:
    """Whether ``generate``'s call sets a penalty or ``min_tokens``, shared or a mapping
    prompt's own."""
    settings = [arguments, *_own_settings(arguments)]
    return any(
        scheduler.Sampling(**{k: s[k] for k in _PENALTIES if k in s}).penalized for s in settings
    )


#: ``generate``'s arguments that shape drafting, which plain decoding does without.
_DRAFTING = (
    "draft",
    "num_steps",
    "topk",
    "num_draft_tokens",
    "sample_drafts",
    "chain_hidden",
    "adaptive_steps",
    "adaptive_margin",
    "block_size",
    "verify_budget",
    "cost_table",
    "min_verify",
    "packed_verify",
    "grammar_drafts",
    "ngram",
    "draft_tp",
)


@attrs.define(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Speculative decoding timed against plain decoding by :func:`compare_plain`.

    ``speculative`` and ``plain`` are the results of the median pass (the pass whose speedup
    is the median of ``speedups``; the upper one of an even count), ``speedups`` every timed
    pass's ratio of speculative to plain tokens per second, in the order they ran.
    """

    speculative: list[Generation]
    plain: list[Generation]
    speedups: tuple[float, ...]

    @property
    def speedup(self) -> float:
        """The median pass's speedup."""
        return (
            self.speculative[0].stats["tokens_per_second"]
            / (self.plain[0].stats["tokens_per_second"])
        )


def compare_plain(
    prompts: str | Sequence[str] | Sequence[Sequence[int]], *, passes: int = 3, **options: Any
) -> Comparison:
    """Decode ``prompts`` with ``generate(prompts, **options)``'s engine and with plain
    decoding of the same model, and time them fairly: both engines are built once and warmed
    by an untimed pass each, then ``passes`` timed passes of each alternate (speculative,
    plain, speculative, ...), so that a drifting machine slows both alike. ``options`` are
    ``generate``'s (``engine`` excepted); ``tp > 1`` runs the whole comparison on each rank.
    """
    if passes < 1:
        raise ValueError(f"passes={passes}: compare at least one timed pass")
    defaults = {n: p.default for n, p in inspect.signature(generate).parameters.items()}
    unknown = sorted(set(options) - set(defaults) | ({"engine", "prompts"} & set(options)))
    if unknown:
        raise TypeError(f"compare_plain got arguments {unknown} that generate does not take")
    arguments = {**defaults, **options, "prompts": prompts}
    if arguments["speculative_config"] is not None:
        arguments = _with_speculative_config(arguments)
    arguments.pop("speculative_config", None)
    if arguments["tp"] > 1 and not distributed.launched():
        run = functools.partial(compare_plain, prompts, passes=passes, **options)
        return distributed.launch(run, arguments["tp"])
    del arguments["engine"]
    speculative = _engine(arguments)
    if speculative.pipeline.name == "plain":
        raise ValueError("compare_plain compares speculative decoding with plain: pass a draft")
    plain = {**arguments, **{k: defaults[k] for k in _DRAFTING}, "algorithm": "plain"}
    engines = (speculative, _engine(plain))
    runs = [[generate(**arguments, engine=e) for e in engines] for _ in range(passes + 1)][1:]
    speedups = tuple(
        s[0].stats["tokens_per_second"] / p[0].stats["tokens_per_second"] for s, p in runs
    )
    median = sorted(range(passes), key=speedups.__getitem__)[passes // 2]
    return Comparison(speculative=runs[median][0], plain=runs[median][1], speedups=speedups)


#: vLLM's ``speculative_config`` keys and the ``generate`` arguments they set.
SPECULATIVE_CONFIG_KEYS = {
    "method": "algorithm",
    "model": "draft",
    "num_speculative_tokens": "num_steps (block drafters: block_size; ngram: num_draft_tokens)",
    "draft_tensor_parallel_size": "draft_tp",
    "prompt_lookup_max": "ngram.max_depth",
    "prompt_lookup_min": "ngram.min_match",
}
#: vLLM ``method`` names spelled otherwise here (any ``*_mtp`` method is ``mtp``).
_VLLM_METHODS = {"draft_model": "standalone"}
#: vLLM's n-gram proposer on the GPU: here ``ngram`` with ``NgramOptions.matcher="device"``.
_VLLM_NGRAM_GPU = "ngram_gpu"


def _with_speculative_config(arguments: dict[str, Any]) -> dict[str, Any]:
    """``generate``'s ``arguments`` with their ``speculative_config`` (vLLM's keys) turned
    into the arguments it stands for; an argument given both ways raises ``ValueError``."""
    config = dict(arguments.pop("speculative_config"))
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config keys {unknown} are not read; speculum reads "
            f"{', '.join(SPECULATIVE_CONFIG_KEYS)}"
        )
    method = config.get("method")
    fields: dict[str, Any] = {}
    if method is not None:
        method = str(method).lower()
        if method == _VLLM_NGRAM_GPU:  # n-gram matched on the device
            method, fields = "ngram", {"matcher": "device"}
        method = "mtp" if method.endswith("_mtp") else _VLLM_METHODS.get(method, method)
    options: dict[str, Any] = {"algorithm": method, "draft": config.get("model")}
    options["draft_tp"] = config.get("draft_tensor_parallel_size")
    tokens = config.get("num_speculative_tokens")
    if tokens is not None:
        name, value = {
            "ngram": ("num_draft_tokens", tokens + 1),
            "dflash": ("block_size", tokens + 1),
            "dspark": ("block_size", tokens),
        }.get(method, ("num_steps", tokens))
        options[name] = value
    lookup = {"max_depth": "prompt_lookup_max", "min_match": "prompt_lookup_min"}
    fields |= {f: config[k] for f, k in lookup.items() if config.get(k) is not None}
    if fields:
        options["ngram"] = attrs.evolve(arguments["ngram"] or NgramOptions(), **fields)
    options = {k: v for k, v in options.items() if v is not None}
    defaults = {n: p.default for n, p in inspect.signature(generate).parameters.items()}
    twice = sorted(k for k in options if k != "ngram" and arguments[k] != defaults[k])
    if twice:
        raise ValueError(
            f"{', '.join(twice)} given both as arguments and through speculative_config; "
            "give each once"
        )
    return {**arguments, **options}


def _one_or_many(value: Any, kind: type) -> tuple[Any, ...]:
    """``value`` as a tuple: a single ``kind`` (a string is one stop string, not its
    characters) or a sequence of them."""
    return (value,) if isinstance(value, kind) else tuple(value)


#: ``generate``'s arguments that make a request's ``scheduler.Sampling``.
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")
_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    *_PENALTIES,
    "json_schema",
    "regex",
    "grammar",
)

#: The settings a prompt given as a mapping may hold for itself (``generate``'s arguments).
REQUEST_SETTINGS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    *_PENALTIES,
    "json_schema",
    "regex",
    "grammar",
    "stop_token_ids",
    "stop_strings",
    "ignore_eos",
    "include_stop_str_in_output",
)


def _request(
    engine: Engine, prompt: str | Sequence[int] | Mapping[str, Any], shared: dict[str, Any]
) -> tuple[list[int], dict[str, Any]]:
    """A prompt's token ids and the keyword arguments of its ``scheduler.add_request``: the
    ``shared`` settings, overridden by a mapping prompt's own (``{"prompt": text}`` or
    ``{"prompt_ids": ids}`` plus any of :data:`REQUEST_SETTINGS`)."""
    settings = dict(shared)
    if isinstance(prompt, Mapping):
        given = [k for k in ("prompt", "prompt_ids") if k in prompt]
        unknown = sorted(set(prompt) - {"prompt", "prompt_ids", *REQUEST_SETTINGS})
        if len(given) != 1 or unknown:
            raise ValueError(
                f"a prompt given as a mapping holds exactly one of 'prompt' (text) and "
                f"'prompt_ids', and settings among {', '.join(REQUEST_SETTINGS)}; got "
                f"{sorted(prompt)}"
            )
        settings.update((k, prompt[k]) for k in REQUEST_SETTINGS if k in prompt)
        prompt = prompt[given[0]]
    sampling = scheduler.Sampling(**{k: settings.pop(k) for k in _SAMPLING})
    settings["stop_token_ids"] = _one_or_many(settings["stop_token_ids"], int)
    settings["stop_strings"] = _one_or_many(settings["stop_strings"], str)
    return _prompt_ids(engine, prompt), {"sampling": sampling, **settings}


def _prompt_ids(engine: Engine, prompt: str | Sequence[int]) -> Sequence[int]:
    """A prompt's token ids: text encoded, ids as given (``add_request`` checks them)."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer.json in the model folder; pass ids")
        return engine.tokenizer.encode(prompt)
    return prompt


def _shown_text(text: str, request: scheduler.Request) -> str:
    """The part of ``request``'s decoded ``text`` its user sees: the text before the first stop
    string it holds (all of it with ``include_stop_str_in_output``), and while the request
    runs, without a tail that may still grow into a stop string (streamed text is never taken
    back)."""
    stops = () if request.include_stop_str_in_output else request.stop_strings
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        return text[: min(found)]
    if not stops or request.finish_reason is not None:
        return text
    # The longest tail of the text that is a proper prefix of some stop string waits.
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


def _result(engine: Engine, request: scheduler.Request, shared: dict[str, float]) -> Generation:
    tokenizer = engine.tokenizer
    text = _shown_text(tokenizer.decode(request.output), request) if tokenizer else None
    finish_reason = request.finish_reason or "length"
    return Generation(
        token_ids=request.output,
        text=text,
        finish_reason=finish_reason,
        stats={
            "num_forward_steps": request.num_forwards,
            "cached_tokens": request.cached_tokens,
            **shared,
            "finish_reason": finish_reason,
            **_length_limit(engine, request, finish_reason),
            **acceptance_stats(request.round_lengths),
        },
        error=request.error,
        logprobs=[_logprob(e) for e in request.logprobs] if request.sampling.logprobs else None,
        prompt_logprobs=None
        if request.sampling.prompt_logprobs is None
        else [e and _logprob(e) for e in request.prompt_logprobs],
    )


def _logprob(entry: scheduler.TokenLogprob) -> dict:
    """One token's log-probabilities in :class:`Generation`'s (JSON) shape."""
    return {
        "token_id": entry.token_id,
        "logprob": entry.logprob,
        "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in entry.top_logprobs],
    }


def _length_limit(
    engine: Engine, request: scheduler.Request, finish_reason: str
) -> dict[str, str | int]:
    """Why a request finished for ``length``: ``length_limit`` is ``max_new_tokens``, or
    ``max_context`` (with its value) when the prompt and the budget did not fit the context,
    so the context cut the budget short; nothing for other finishes."""
    if finish_reason != "length":
        return {}
    context = engine.config.max_context
    if len(request.prompt) + request.max_new_tokens > context:
        return {"length_limit": "max_context", "max_context": context}
    return {"length_limit": "max_new_tokens"}


def acceptance_stats(round_lengths: Sequence[int]) -> dict[str, float | int | list]:
    """Acceptance metrics from a histogram of tokens emitted per decoding round.

    ``accept_length_mean`` counts the bonus token (SGLang's convention; vLLM's "mean accepted
    tokens" is one less); ``accept_rate_per_position[d]`` is the fraction of rounds whose draft
    token at depth ``d + 1`` was accepted. Histograms of several requests add elementwise.
    """
    rounds = sum(round_lengths)
    emitted = sum(k * n for k, n in enumerate(round_lengths))
    depths = range(1, len(round_lengths) - 1)  # a round emitting k tokens accepted depths < k
    return {
        "num_rounds": rounds,
        "accept_length_mean": emitted / rounds if rounds else 1.0,
        "accept_length_histogram": list(round_lengths),
        "accept_rate_per_position": [
            sum(round_lengths[depth + 1 :]) / rounds if rounds else 0.0 for depth in depths
        ],
    }
