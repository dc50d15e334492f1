"""``generate``: the simple Python entry point, built on the reference scheduler."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from speculum.pipelines.adaptive import AdaptivePolicy
from speculum.runtime import distributed, scheduler
from speculum.runtime.default_model import (
    DEFAULT_ALGORITHM,
    default_draft_dir,
    default_model_dir,
)
from speculum.runtime.engine import Engine, NgramOptions, SpecOptions, build_engine

__all__ = ["Generation", "generate", "run_to_completion", "acceptance_stats"]


@attrs.define(frozen=True, slots=True, kw_only=True)
class Generation:
    """One prompt's result: generated ids (prompt excluded), their text, and statistics.

    ``stats`` holds ``num_forward_steps`` (target forwards that involved the request: prefill
    chunks plus decoding rounds), ``num_rounds`` (decoding rounds), ``accept_length_mean``
    (tokens emitted per decoding round, bonus token included; 1.0 for plain decoding),
    ``tokens_per_second``, the scheduler's ``host_ms_per_step``, ``hidden_host_ms_per_step``
    and ``blocked_ms_per_step`` (``scheduler.host_stats``, over the whole call) and
    ``finish_reason``. A prompt the engine could not decode (its logits turned NaN, say) ends
    with ``finish_reason == "error"``, the tokens decoded before that, and ``error`` saying why;
    the other prompts are unaffected.

    ``logprobs`` (``None`` unless asked for) holds one entry per generated token:
    ``{"token_id": int, "logprob": float, "top_logprobs": [{"token_id": int, "logprob":
    float}, ...]}``, the token's log-probability under the target's distribution that decided
    it and that distribution's most likely tokens, most likely first
    (``scheduler.Sampling.logprobs``, ``docs/request_controls.md``).
    """

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str
    stats: dict[str, float | int | str]
    error: str | None = None
    logprobs: list[dict] | None = None


def run_to_completion(
    engine: Engine, state: scheduler.SchedulerState
) -> tuple[scheduler.SchedulerState, dict[int, scheduler.Request]]:
    """Step until every request has finished; returns the final state and finished requests."""
    finished: dict[int, scheduler.Request] = {}
    while not scheduler.is_idle(state):
        state, outputs = scheduler.step(engine, state)
        finished.update((o.rid, o.request) for o in outputs if o.finished)
    return state, finished


def generate(
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
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
    ngram: NgramOptions | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    logprobs: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    stop_strings: tuple[str, ...] = (),
    ignore_eos: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    cuda_graphs: bool = True,
    overlap: bool = False,
    tp: int = 1,
    draft_tp: int | None = None,
) -> list[Generation]:
    """Generate a completion for each prompt (text, or a list of token ids).

    With neither ``model`` nor ``engine``, the bundled default model runs, by default with its
    EAGLE-3 draft (``algorithm`` None means that, or plain decoding for any other model). All
    prompts are decoded together by the continuous-batching scheduler; each result is what that
    prompt yields alone. Speculative algorithms take their draft from ``draft`` and the round's
    shape from ``num_steps``, ``topk`` and ``num_draft_tokens`` (tree nodes, root included);
    ``sample_drafts`` samples drafts instead of taking the draft's top-k; ``chain_hidden``
    chains multi-layer EAGLE's MTP layers. ``adaptive_steps`` (e.g. ``(0, 1, 3, 5)``) replaces
    ``num_steps`` with several chain depths, 0 meaning no speculation, and each round runs the
    one with the best measured goodput at the batch's size (within ``adaptive_margin`` of the
    best, variants keep being sampled; see ``docs/adaptive.md``). ``algorithm="ngram"``
    chains multi-layer EAGLE's MTP layers. Block drafters (``dflash``, ``dspark``) take
    ``block_size`` (default: the draft's) and the verify budget ``verify_budget``,
    ``cost_table`` and ``min_verify`` (``SpecOptions``). ``algorithm="ngram"``
    needs no draft; ``ngram`` holds its options. On CUDA, decoding rounds run as CUDA graphs
    unless ``cuda_graphs`` is False. ``overlap`` makes the scheduler prepare each step while
    the device runs the previous one (same tokens; see ``docs/overlap.md``). ``logprobs`` N > 0
    returns each generated token's log-probability and its N most likely alternatives
    (``Generation.logprobs``); an engine built here computes N, one given must have been built
    with ``max_logprobs >= N``.

    ``tp > 1`` shards the model over ``tp`` processes (tensor parallelism; ``draft_tp=1``
    keeps the draft whole on every rank): inside a group started by torchrun, this process is
    one rank; otherwise ``tp`` worker processes are started, each runs this call, and rank 0's
    result is returned. Every rank decodes rank 0's requests and returns the same results.
    """
    arguments = dict(locals())  # this call's arguments, for the worker processes to repeat
    # Checked here, before any model loads or worker starts (scheduler.Sampling).
    sampling = scheduler.Sampling(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, logprobs=logprobs
    )
    if engine is None and tp > 1 and not distributed.launched():
        del arguments["engine"]
        return distributed.launch(functools.partial(generate, **arguments), tp)
    if engine is None:
        if model is None:
            model = default_model_dir()
            if algorithm is None:
                algorithm, draft = DEFAULT_ALGORITHM, draft or default_draft_dir()
        engine = build_engine(
            model,
            algorithm=algorithm or "plain",
            draft=draft,
            spec=SpecOptions(
                num_steps=num_steps,
                topk=topk,
                num_draft_tokens=num_draft_tokens,
                sample_drafts=sample_drafts,
                chain_hidden=chain_hidden,
                adaptive_steps=adaptive_steps,
                adaptive_policy=AdaptivePolicy(margin=adaptive_margin),
                block_size=block_size,
                verify_budget=verify_budget,
                cost_table=cost_table,
                min_verify=min_verify,
            ),
            device=device,
            dtype=dtype,
            ngram=ngram,
            cuda_graphs=cuda_graphs,
            overlap=overlap,
            max_logprobs=sampling.logprobs,
            tp=distributed.tensor_parallel(tp, device),
            draft_tp=draft_tp,
        )
    batch = [prompts] if isinstance(prompts, str) else list(prompts)
    # Every rank must schedule the same requests for the ranks' collectives to pair up: rank 0's.
    ids, sampling, max_new_tokens, stop_token_ids, stop_strings, ignore_eos = engine.tp.from_leader(
        (
            [_prompt_ids(engine, p) for p in batch],
            sampling,
            max_new_tokens,
            stop_token_ids,
            stop_strings,
            ignore_eos,
        )
    )
    state, rids = scheduler.new_state(engine), []
    for prompt in ids:
        state, rid = scheduler.add_request(
            engine,
            state,
            prompt,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            stop_strings=stop_strings,
            ignore_eos=ignore_eos,
        )
        rids.append(rid)
    start = time.perf_counter()
    final, finished = run_to_completion(engine, state)
    elapsed = time.perf_counter() - start
    total = sum(len(r.output) for r in finished.values())
    shared = {"tokens_per_second": total / max(elapsed, 1e-9), **scheduler.host_stats(final)}
    return [_result(engine, finished[rid], shared) for rid in rids]


def _prompt_ids(engine: Engine, prompt: str | Sequence[int]) -> Sequence[int]:
    """A prompt's token ids: text encoded, ids as given (``add_request`` checks them)."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer.json in the model folder; pass ids")
        return engine.tokenizer.encode(prompt)
    return prompt


def _result(engine: Engine, request: scheduler.Request, shared: dict[str, float]) -> Generation:
    text = engine.tokenizer.decode(request.output) if engine.tokenizer else None
    return Generation(
        token_ids=request.output,
        text=text,
        finish_reason=request.finish_reason or "length",
        stats={
            "num_forward_steps": request.num_forwards,
            **shared,
            "finish_reason": request.finish_reason or "length",
            **acceptance_stats(request.round_lengths),
        },
        error=request.error,
        logprobs=_logprobs(request) if request.sampling.logprobs else None,
    )


def _logprobs(request: scheduler.Request) -> list[dict]:
    """``request``'s token log-probabilities in :class:`Generation`'s (JSON) shape."""
    return [
        {
            "token_id": entry.token_id,
            "logprob": entry.logprob,
            "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in entry.top_logprobs],
        }
        for entry in request.logprobs
    ]


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
