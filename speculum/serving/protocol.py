"""OpenAI's request and response shapes, to and from the scheduler's requests and outputs.

:func:`completion_job` and :func:`chat_job` check a request body and turn it into a :class:`Job`
(the token ids of each choice's prompt and ``scheduler.add_request``'s settings), raising
:class:`APIError` (HTTP 400 with OpenAI's error object) for anything they cannot honour: a
malformed or mistyped field, an unknown field, a prompt that fills the context, a model name the
server does not serve, a control the engine was started without, or one speculum serve does
not do (``echo``, ``suffix``, tools). Nothing is silently ignored. :class:`ResponseBuilder`
turns a job's ``scheduler.RequestOutput`` values into OpenAI's response, whole or as stream
chunks.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from speculum.runtime import scheduler
from speculum.runtime.engine import Engine
from speculum.runtime.generate import _TextStream, acceptance_stats, completion_seed
from speculum.serving.chat import ChatTemplate, TemplateError, render

__all__ = [
    "APIError",
    "Job",
    "ResponseBuilder",
    "chat_job",
    "completion_job",
    "error_body",
]


class APIError(Exception):
    """A request the server refuses, as OpenAI reports it: an HTTP ``status`` and an error
    object ``{"message", "type", "param", "code"}`` (:meth:`body`)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@attrs.define(frozen=True, slots=True, kw_only=True)
class Job:
    """A checked OpenAI request: one engine request per choice (``prompts``, token ids: ``n``
    per prompt of the request, prompt after prompt), each with ``settings``,
    ``scheduler.add_request``'s keyword arguments (the sampling settings, the token budget,
    the stop conditions). ``top_logprobs`` is how many alternatives each token's
    log-probability shows (None: no log-probabilities); ``include_usage`` asks a stream for a
    last chunk with the usage; ``return_token_ids`` (vLLM's extension) adds each choice's
    generated ``token_ids``; ``prompt_logprobs`` (vLLM's extension) is how many alternatives
    each prompt token's log-probability shows (None: none asked for)."""

    chat: bool
    model: str
    prompts: tuple[tuple[int, ...], ...]
    settings: tuple[Mapping[str, Any], ...]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    return_token_ids: bool = False
    prompt_logprobs: int | None = None


#: vLLM's structured-output fields, each with the ``scheduler.Sampling`` field it sets.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}
#: Fields every request may carry, besides its prompt and the endpoint's own fields.
_COMMON = (
    "model",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "logit_bias",
    "response_format",
    *_GUIDED,
    "stream",
    "stream_options",
    "return_token_ids",
    "prompt_logprobs",
    "user",
)
#: Fields speculum serve does not do, each accepted at its no-op value only (``best_of`` is
#: read with ``n``: it may equal it).
_UNSUPPORTED = {
    "echo": False,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
}
_COMPLETION_FIELDS = {"prompt", "logprobs", "best_of", "echo", "suffix", *_COMMON}
_CHAT_FIELDS = {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    *_COMMON,
}
#: OpenAI's default completion budget of ``/v1/completions`` (chat's is the rest of the context).
COMPLETION_MAX_TOKENS = 16
#: OpenAI's presence and frequency penalties and vLLM's repetition penalty, by
#: ``scheduler.Sampling``'s names (which are theirs).
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _check_fields(body: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse unknown fields, and fields speculum serve does not do at another value than
    their no-op one."""
    for name in body:
        if name not in allowed:
            raise APIError(
                f"unknown field {name!r}; this endpoint reads {', '.join(sorted(allowed))}",
                param=name,
            )
    for name, noop in _UNSUPPORTED.items():
        if body.get(name, noop) != noop:
            raise APIError(
                f"{name}={body[name]!r} is not supported by speculum serve; leave it out "
                f"(or {noop!r})",
                param=name,
                code="unsupported_parameter",
            )


def _typed(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """``body[name]`` when it is one of ``kinds`` (bools are no numbers), None when absent or
    null; anything else is a 400 naming the field and ``what`` it takes."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(f"{name}={value!r}: expected {what}", param=name, code="invalid_type")
    return value


_NUMBER = ((int, float), "a number")


def _sampling(body: Mapping[str, Any]) -> scheduler.Sampling:
    """The request's sampling settings, OpenAI's defaults where absent (temperature 1, a
    random seed), each field checked by ``scheduler.Sampling`` on its own so that an error
    names it (``response_format`` and the ``guided_*`` fields by their own names)."""
    given: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", *_PENALTIES):
        value = _typed(body, name, *_NUMBER)
        if value is not None:
            given[name] = value
    top_k = _typed(body, "top_k", (int,), "an integer")
    if top_k is not None:
        given["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1 is off, as 0 is here
    min_tokens = _typed(body, "min_tokens", (int,), "an integer")
    if min_tokens is not None:
        given["min_tokens"] = min_tokens
    seed = _typed(body, "seed", (int,), "an integer")
    given["seed"] = secrets.randbits(63) if seed is None else seed
    bias = _typed(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    if bias:
        given["logit_bias"] = bias
    given.setdefault("temperature", 1.0)
    params = {name: name for name in given}
    structured = _structured(body)
    if structured is not None:
        param, field, value = structured
        given[field], params[field] = value, param
    for name, value in given.items():
        try:
            scheduler.Sampling(**{name: value})
        except (TypeError, ValueError, ImportError) as err:
            where = "" if params[name] == name else f"{params[name]}: "
            raise APIError(f"{where}{err}", param=params[name]) from err
    return scheduler.Sampling(**given)


def _structured(body: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """The request's constraint on its output as ``(param, field, value)``: the request field
    that gives it, the ``scheduler.Sampling`` field it sets and that field's value; None when
    the output is free. At most one of ``response_format`` and vLLM's ``guided_*`` fields."""
    found = []
    form = _response_format(body.get("response_format"))
    if form is not None:
        found.append(("response_format", "json_schema", form))
    found += [(p, field, body[p]) for p, field in _GUIDED.items() if body.get(p) is not None]
    if len(found) > 1:
        raise APIError(
            f"{found[0][0]} and {found[1][0]} both constrain the output; give one",
            param=found[1][0],
        )
    return found[0] if found else None


#: The JSON schema of ``{"type": "json_object"}``: any JSON object.
_ANY_OBJECT = {"type": "object"}


def _response_format(form: Any) -> Mapping[str, Any] | None:
    """The JSON schema OpenAI's ``response_format`` asks for: None for ``{"type": "text"}``,
    any object for ``{"type": "json_object"}``, the schema of ``{"type": "json_schema",
    "json_schema": {"name", "schema", "description", "strict"}}`` (its output always follows
    the schema, which is what ``strict`` asks)."""
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text" and set(form) == {"type"}:
        return None
    if kind == "json_object" and set(form) == {"type"}:
        return _ANY_OBJECT
    spec = form.get("json_schema") if kind == "json_schema" else None
    if (
        isinstance(spec, dict)
        and set(form) == {"type", "json_schema"}
        and isinstance(spec.get("schema"), dict)
        and set(spec) <= {"name", "description", "schema", "strict"}
    ):
        return spec["schema"]
    raise APIError(
        f"response_format={form!r}: expected {{'type': 'text'}}, {{'type': 'json_object'}} "
        "or {'type': 'json_schema', 'json_schema': {'name': NAME, 'schema': {...}}}",
        param="response_format",
    )


def _n(body: Mapping[str, Any], prompts: int, max_choices: int) -> int:
    """How many choices each of the ``prompts`` gets (``n``, 1 by default), at most
    ``max_choices`` in all; ``best_of``, where given, must equal it (every completion decoded
    is returned)."""
    n = _typed(body, "n", (int,), "an integer >= 1")
    if n is not None and n < 1:
        raise APIError(f"n={n}: expected an integer >= 1", param="n")
    n = n or 1
    if n * prompts > max_choices:
        raise APIError(
            f"the request asks for {n * prompts} completions ({prompts} prompts, n={n}) and "
            f"this server holds at most {max_choices} live requests (--max-batch plus "
            "--max-queue); ask for fewer",
            param="n" if n > 1 else "prompt",
        )
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != n:
        raise APIError(
            f"best_of={best_of} is not supported by speculum serve: it returns every "
            f"completion it decodes; leave it out (or {n}, as n)",
            param="best_of",
            code="unsupported_parameter",
        )
    return n


def _stops(body: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """``add_request``'s stop settings: ``stop`` (a string or a list of them),
    ``stop_token_ids``, ``ignore_eos`` and ``include_stop_str_in_output``."""
    stop = body.get("stop")
    strings = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise APIError(
            f"stop={stop!r}: expected a non-empty string or a list of them", param="stop"
        )
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_token(t, vocab) for t in ids):
        raise APIError(
            f"stop_token_ids={ids!r}: expected a list of token ids in [0, {vocab})",
            param="stop_token_ids",
        )
    flags = {
        name: bool(_typed(body, name, (bool,), "true or false"))
        for name in ("ignore_eos", "include_stop_str_in_output")
    }
    return {"stop_strings": tuple(strings), "stop_token_ids": tuple(ids), **flags}


def _is_token(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def _model(body: Mapping[str, Any], served: Sequence[str]) -> str:
    """The served model name the request asks for (the first one when it names none)."""
    model = body.get("model")
    if model is None:
        return served[0]
    if model not in served:
        raise APIError(
            f"the model {model!r} does not exist here; this server serves "
            f"{', '.join(map(repr, served))}",
            param="model",
            code="model_not_found",
        )
    return model


def _logprobs_wanted(
    count: int | None, engine: Engine, param: str, *, least: int = 1
) -> int | None:
    """``count`` alternatives per token, checked against what the engine computes: at most
    ``max_logprobs``, and at least ``least`` computed whatever the count (a generated token's
    own value is read from one computed alternative; a prompt token's needs none)."""
    if count is None:
        return None
    if count < 0:
        raise APIError(
            f"{param}={count}: expected an integer >= 0 (vLLM's -1, the whole vocabulary, is "
            "not supported)",
            param=param,
        )
    most = engine.config.max_logprobs
    if max(count, least) > most:
        fix = (
            "start the server with --max-logprobs N to allow them"
            if most == 0
            else f"ask for at most {most} (speculum serve --max-logprobs)"
        )
        raise APIError(
            f"{param}={count}: this server computes at most {most} alternatives per token; {fix}",
            param=param,
        )
    return count


def _check_engine_applies(
    body: Mapping[str, Any], sampling: scheduler.Sampling, engine: Engine
) -> None:
    """Refuse a penalty the server was started without, and structured output an engine
    cannot follow (one without a tokenizer), naming the field."""
    if sampling.penalized and not engine.config.penalties:
        name = next(n for n in (*_PENALTIES, "min_tokens") if body.get(n) is not None)
        raise APIError(f"{name}: this server was started with --no-penalties", param=name)
    structured = _structured(body)
    if structured is None or engine.tokenizer is not None:
        return
    raise APIError(
        f"{structured[0]}: structured output reads token texts, and this server has no "
        "tokenizer.json to read them from",
        param=structured[0],
    )


def _common(
    body: Mapping[str, Any],
    engine: Engine,
    served: Sequence[str],
    prompts,
    param: str,
    max_choices: int,
) -> dict[str, Any]:
    """What both endpoints read alike, checked: the model, the sampling and stop settings, the
    budget, the stream flags, each prompt against the context."""
    vocab = engine.resources.target.config.vocab_size
    context = engine.config.max_context
    model = _model(body, served)
    for prompt in prompts:
        if len(prompt) >= context:
            raise APIError(
                f"this model's context holds {context} tokens, and the prompt has "
                f"{len(prompt)}, leaving no room for a completion; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
    bias = _typed(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    if bias and not engine.config.logit_bias:
        raise APIError(
            "logit_bias: this server was started with --no-logit-bias", param="logit_bias"
        )
    sampling = _sampling(body)
    _check_engine_applies(body, sampling, engine)
    bad = [t for t, _ in sampling.logit_bias if t >= vocab]
    if bad:
        raise APIError(
            f"logit_bias names token ids {bad[:8]} outside the vocabulary [0, {vocab})",
            param="logit_bias",
        )
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    prompt_logprobs = _prompt_logprobs(body, engine, stream)
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = options.get("include_usage", False)
    if set(options) - {"include_usage"} or not isinstance(include_usage, bool):
        raise APIError(
            f"stream_options={options!r}: expected {{'include_usage': true or false}}",
            param="stream_options",
        )
    return {
        "model": model,
        "n": _n(body, len(prompts), max_choices),
        "sampling": attrs.evolve(sampling, prompt_logprobs=prompt_logprobs),
        "stops": _stops(body, vocab),
        "stream": stream,
        "include_usage": stream and include_usage,
        "return_token_ids": bool(_typed(body, "return_token_ids", (bool,), "true or false")),
    }


def _prompt_logprobs(body: Mapping[str, Any], engine: Engine, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: alternatives per prompt token (None: none), at most the
    server's ``--max-logprobs``; refused with ``stream`` (as vLLM refuses it)."""
    count = _typed(body, "prompt_logprobs", (int,), "an integer >= 0")
    count = _logprobs_wanted(count, engine, "prompt_logprobs", least=0)
    if count is not None and stream:
        raise APIError(
            "prompt_logprobs are not available with stream: true (as in vLLM); ask for them "
            "without streaming",
            param="prompt_logprobs",
        )
    return count


def _job(
    chat: bool,
    common: dict[str, Any],
    prompts: list[tuple[int, ...]],
    max_tokens: int | None,
    default_budget: int | None,
    top_logprobs: int | None,
    context: int,
) -> Job:
    """The job of ``prompts``: ``n`` engine requests per prompt, prompt after prompt (choice
    ``i * n + j`` is completion ``j`` of prompt ``i``, as vLLM numbers them), completion ``j``
    seeded as ``generate``'s (``generate.completion_seed``)."""
    sampling, n = common["sampling"], common["n"]
    if top_logprobs is not None:  # 0 alternatives still report the token's own value
        sampling = attrs.evolve(sampling, logprobs=max(top_logprobs, 1))
    settings = []
    for prompt in prompts:
        budget = max_tokens or default_budget or context - len(prompt)
        if sampling.min_tokens > budget:
            raise APIError(
                f"min_tokens={sampling.min_tokens} exceeds the completion's budget of {budget} "
                "tokens (max_tokens); lower min_tokens or raise max_tokens",
                param="min_tokens",
            )
        settings += [
            {
                "sampling": attrs.evolve(sampling, seed=completion_seed(sampling.seed, j)),
                "max_new_tokens": budget,
                **common["stops"],
            }
            for j in range(n)
        ]
    return Job(
        chat=chat,
        model=common["model"],
        prompts=tuple(p for p in prompts for _ in range(n)),
        settings=tuple(settings),
        n=n,
        stream=common["stream"],
        include_usage=common["include_usage"],
        top_logprobs=top_logprobs,
        return_token_ids=common["return_token_ids"],
        prompt_logprobs=sampling.prompt_logprobs,
    )


def _max_tokens(body: Mapping[str, Any], name: str) -> int | None:
    value = _typed(body, name, (int,), "an integer >= 1")
    if value is not None and value < 1:
        raise APIError(f"{name}={value}: expected an integer >= 1", param=name)
    return value


def _prompt_ids(engine: Engine, prompt: Any) -> list[tuple[int, ...]]:
    """``/v1/completions``'s ``prompt``: text, token ids, or a list of either (a batch)."""
    vocab = engine.resources.target.config.vocab_size
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(
            "prompt: expected text, a list of token ids, or a non-empty list of either",
            param="prompt",
        )
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            if engine.tokenizer is None:
                raise APIError(
                    "text prompts need a tokenizer.json in the model folder; send token ids",
                    param="prompt",
                )
            ids = engine.tokenizer.encode(item)
        elif isinstance(item, list) and all(_is_token(t, vocab) for t in item):
            ids = item
        else:
            raise APIError(
                f"prompt: {item!r} is neither text nor a list of token ids in [0, {vocab})",
                param="prompt",
            )
        if not ids:
            raise APIError("prompt: a prompt is empty; give at least one token", param="prompt")
        prompts.append(tuple(ids))
    return prompts


def completion_job(body: Any, engine: Engine, served: Sequence[str], *, max_choices: int) -> Job:
    """A ``/v1/completions`` request body as a :class:`Job` of at most ``max_choices`` engine
    requests (``n`` per prompt); :class:`APIError` when refused."""
    body = _object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    if "prompt" not in body:
        raise APIError("prompt is required", param="prompt", code="missing_required_parameter")
    prompts = _prompt_ids(engine, body["prompt"])
    common = _common(body, engine, served, prompts, "prompt", max_choices)
    logprobs = _logprobs_wanted(_typed(body, "logprobs", (int,), "an integer"), engine, "logprobs")
    max_tokens = _max_tokens(body, "max_tokens")
    context = engine.config.max_context
    return _job(False, common, prompts, max_tokens, COMPLETION_MAX_TOKENS, logprobs, context)


def _message_text(message: Any, index: int) -> dict[str, Any]:
    """A chat message with its content as one string (text parts joined), as templates read
    it; image and audio parts are refused."""
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(f"{param}: expected an object with a string 'role'", param=param)
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(
                    f"{param}.content: only text parts are supported, not {part!r}",
                    param=param,
                )
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    elif content is not None and not isinstance(content, str):
        raise APIError(f"{param}.content: expected a string or a list of text parts", param=param)
    return {**message, "content": content}


def chat_job(
    body: Any,
    engine: Engine,
    served: Sequence[str],
    template: ChatTemplate | None,
    *,
    max_choices: int,
) -> Job:
    """A ``/v1/chat/completions`` request body as a :class:`Job` of at most ``max_choices``
    engine requests (``n``), its messages rendered with the model's chat ``template``;
    :class:`APIError` when refused (also when the model folder has no template)."""
    body = _object(body)
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(
            "messages: expected a non-empty list of {'role', 'content'} objects",
            param="messages",
        )
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    if template is None or engine.tokenizer is None:
        raise APIError(
            "this model has no chat template (no chat_template in its tokenizer_config.json, "
            "no chat_template.jinja), so chat messages cannot be turned into a prompt; use "
            "/v1/completions with the prompt text, or add a chat template to the model folder",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = render(template, messages)
    except TemplateError as err:
        raise APIError(str(err), param="messages") from err
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False))
    if not prompt:
        raise APIError("messages: the rendered prompt is empty", param="messages")
    common = _common(body, engine, served, [prompt], "messages", max_choices)
    wants = _typed(body, "logprobs", (bool,), "true or false")
    top = _typed(body, "top_logprobs", (int,), "an integer")
    if top is not None and not wants:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = _logprobs_wanted((top or 0) if wants else None, engine, "top_logprobs")
    max_tokens = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    context = engine.config.max_context
    return _job(True, common, [prompt], max_tokens, None, logprobs, context)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


@attrs.define(slots=True)
class _Choice:
    """What one choice has produced so far (the builder's own, mutable bookkeeping)."""

    stream: Any = None
    pieces: list[str] = attrs.field(factory=list)
    text: str = ""
    logprobs: list[dict] = attrs.field(factory=list)
    offset: int = 0
    request: scheduler.Request | None = None


class ResponseBuilder:
    """One job's OpenAI response, built from its engine outputs as they come.

    :meth:`feed` takes each ``scheduler.RequestOutput`` of choice ``index`` and returns the
    stream chunk it makes (None when it shows nothing yet: a multi-byte character cut between
    tokens, or a tail that may grow into a stop string); :meth:`response` is the whole response
    once every choice has finished. Text goes through ``generate``'s own streaming, so a
    stop string is never shown and the pieces add up to ``speculum.generate``'s text.
    """

    def __init__(self, job: Job, engine: Engine) -> None:
        self.job, self.engine = job, engine
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in job.prompts]

    @property
    def finished(self) -> bool:
        """Whether every choice has finished."""
        return all(c.request is not None and c.request.finish_reason for c in self.choices)

    def feed(self, index: int, output: scheduler.RequestOutput) -> dict[str, Any] | None:
        """Take one step's output of choice ``index``; the chunk it makes, if any."""
        choice = self.choices[index]
        if choice.stream is None:
            choice.stream = _TextStream(
                self.engine, lambda _, __, text: choice.pieces.append(text), [output.rid]
            )
        choice.stream(output)
        choice.request = output.request
        piece = "".join(choice.pieces)
        choice.pieces.clear()
        choice.text += piece
        new = output.request.logprobs[len(output.request.logprobs) - len(output.new_token_ids) :]
        logprobs = self._logprobs(choice, new) if self.job.top_logprobs is not None else None
        reason = output.request.finish_reason
        ids = self.job.return_token_ids and output.new_token_ids
        if not (piece or logprobs or ids or reason):
            return None
        entry = self._chunk_choice(index, piece, logprobs, reason)
        if self.job.return_token_ids:
            entry["token_ids"] = list(output.new_token_ids)
        return self.chunk([entry])

    def _logprobs(self, choice: _Choice, entries) -> Any:
        """``entries`` (``scheduler.TokenLogprob``) in the endpoint's log-probability format,
        also kept for the whole response."""
        top, tokenizer, token = self.job.top_logprobs, self.engine.tokenizer, self._token

        def chat_entry(token_id: int, logprob: float) -> dict[str, Any]:
            data = tokenizer.token_bytes(token_id) if tokenizer else b""
            return {"token": token(token_id), "logprob": logprob, "bytes": list(data)}

        if self.job.chat:
            content = [
                {
                    **chat_entry(e.token_id, e.logprob),
                    "top_logprobs": [chat_entry(t, lp) for t, lp in e.top_logprobs[:top]],
                }
                for e in entries
            ]
            choice.logprobs.extend(content)
            return {"content": content}
        tokens = [token(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(choice.offset)
            choice.offset += len(text)
        part = {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token(t): lp for t, lp in e.top_logprobs[:top]} for e in entries],
            "text_offset": offsets,
        }
        choice.logprobs.append(part)
        return part

    def _token(self, token_id: int) -> str:
        """A token's own text (its id, without a tokenizer)."""
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer else str(token_id)

    def _prompt_logprobs(self, request: scheduler.Request) -> dict[str, Any]:
        """``{"prompt_logprobs": [...]}``, vLLM's, when the job asked for them: None for the
        first prompt token, then per token an object mapping token ids (as text) to
        ``{"logprob", "rank", "decoded_token"}``: the prompt token's first, then its
        alternatives, most likely first (``rank`` 1, 2, ...; the prompt token's rank is None
        unless it is among them)."""
        if self.job.prompt_logprobs is None:
            return {}

        def entry(e: scheduler.TokenLogprob) -> dict[str, dict[str, Any]]:
            ranks = {t: rank for rank, (t, _) in enumerate(e.top_logprobs, 1)}
            shown = {e.token_id: e.logprob}
            shown.update((t, lp) for t, lp in e.top_logprobs if t != e.token_id)
            return {
                str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": self._token(t)}
                for t, lp in shown.items()
            }

        return {"prompt_logprobs": [e and entry(e) for e in request.prompt_logprobs]}

    def _chunk_choice(self, index: int, piece: str, logprobs: Any, reason: str | None) -> dict:
        if self.job.chat:
            delta = {"content": piece} if piece else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": reason}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        """A stream chunk holding ``choices`` (and ``usage``, for the last chunk)."""
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "choices": choices,
        }
        return chunk if usage is None else {**chunk, "usage": usage}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks a stream opens with: chat's assistant role, one per choice."""
        if not self.job.chat:
            return []
        role = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
            for i in range(len(self.choices))
        ]

    def errors(self) -> list[str]:
        """The error of each choice the engine could not decode."""
        return [c.request.error for c in self.choices if c.request and c.request.error]

    def usage(self) -> dict[str, Any]:
        """Token counts (``prompt_tokens_details.cached_tokens``: prompt tokens found in the
        prefix cache, as OpenAI's), and the speculative statistics in the ``speculative``
        extension: ``accept_length_mean`` (tokens per decoding round, bonus included),
        ``accepted_draft_tokens`` and ``num_rounds``."""
        requests = [c.request for c in self.choices if c.request is not None]
        # A prompt counts once, however many choices it has (as OpenAI's and vLLM's usage).
        firsts = [c.request for c in self.choices[:: self.job.n] if c.request is not None]
        prompt = sum(len(r.prompt) for r in firsts)
        completion = sum(len(r.output) for r in requests)
        histogram = _sum_histograms([r.round_lengths for r in requests])
        stats = acceptance_stats(histogram)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
            "speculative": {
                "algorithm": self.engine.pipeline.name,
                "num_rounds": stats["num_rounds"],
                "accept_length_mean": stats["accept_length_mean"],
                "accepted_draft_tokens": accepted_draft_tokens(histogram),
            },
        }

    def response(self) -> dict[str, Any]:
        """The whole response, once every choice has finished."""
        choices = []
        for index, choice in enumerate(self.choices):
            reason = choice.request.finish_reason
            logprobs = None
            if self.job.top_logprobs is not None:
                logprobs = (
                    {"content": choice.logprobs} if self.job.chat else _joined(choice.logprobs)
                )
            if self.job.chat:
                content = {"message": {"role": "assistant", "content": choice.text}}
            else:
                content = {"text": choice.text}
            ids = {"token_ids": list(choice.request.output)} if self.job.return_token_ids else {}
            # Completions carry each choice's prompt's (vLLM's places them), chat the response.
            prompt = {} if self.job.chat else self._prompt_logprobs(choice.request)
            choices.append(
                {
                    "index": index,
                    **content,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    **ids,
                    **prompt,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "choices": choices,
            "usage": self.usage(),
            **(self._prompt_logprobs(self.choices[0].request) if self.job.chat else {}),
        }


def _joined(parts: list[dict]) -> dict[str, list]:
    """Completion log-probability parts (one per chunk) as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for part in parts for x in part[k]] for k in keys}


def _sum_histograms(histograms: Sequence[Sequence[int]]) -> list[int]:
    width = max(map(len, histograms), default=0)
    return [sum(h[k] for h in histograms if k < len(h)) for k in range(width)]


def accepted_draft_tokens(histogram: Sequence[int]) -> int:
    """Draft tokens accepted over the rounds of an acceptance-length histogram: each round
    emitting ``k`` tokens accepted ``k - 1`` drafts (the last is the bonus token)."""
    return sum((k - 1) * n for k, n in enumerate(histogram) if k >= 1)
