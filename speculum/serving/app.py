"""The ASGI application of ``speculum serve`` (FastAPI), and :func:`serve`, which runs it.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream`` as server-sent events ending with ``data: [DONE]``) and ``GET
/metrics``. Every refusal is OpenAI's error object with an HTTP status: 400 for a request that
cannot be honoured, 401 for a missing or wrong API key, 429 when the server is full, 500 when
the engine could not decode a request. Handlers only parse, submit to the :class:`EngineLoop`
and format; a client that disconnects cancels its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from speculum.runtime import scheduler
from speculum.runtime.engine import Engine
from speculum.serving import protocol
from speculum.serving.chat import ChatTemplate
from speculum.serving.engine_loop import Admitted, Channel, EngineLoop, Failed, QueueFull, Ticket
from speculum.serving.metrics import Metrics
from speculum.serving.protocol import APIError, Job, ResponseBuilder, error_body

__all__ = ["create_app", "serve"]


def create_app(
    engine: Engine,
    *,
    served_model_names: Sequence[str],
    chat_template: ChatTemplate | None = None,
    api_key: str | None = None,
    max_queue: int = 256,
) -> FastAPI:
    """The server's application over ``engine``: one :class:`EngineLoop`, started and stopped
    (after its live requests finish) with the application. ``served_model_names`` are the
    names requests may give as ``model`` (the first is the default); ``api_key``, when given,
    is required as ``Authorization: Bearer KEY`` on every ``/v1`` endpoint; at most
    ``max_batch + max_queue`` requests are live at once (more get 429)."""
    names = tuple(served_model_names)
    metrics = Metrics(engine.pipeline.name, engine.config.num_pages)
    loop = EngineLoop(engine, max_live=engine.config.max_batch + max_queue, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        # Uvicorn has let in-flight responses finish; the loop finishes whatever is left.
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="speculum", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                "missing or wrong API key: send the server's --api-key as "
                "'Authorization: Bearer KEY'",
                code="invalid_api_key",
                status=401,
            )

    v1 = [Depends(authorize)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "speculum",
                    "max_model_len": engine.config.max_context,
                }
                for name in names
            ],
        }

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        body = await _json(request)
        job = protocol.completion_job(body, engine, names, max_choices=loop.max_live)
        return await _respond(request, job, engine, loop)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        body = await _json(request)
        job = protocol.chat_job(body, engine, names, chat_template, max_choices=loop.max_live)
        return await _respond(request, job, engine, loop)

    return app


async def _json(request: Request) -> Any:
    """The request's body as JSON; a 400 when it is not."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise APIError(f"the request body is not valid JSON: {err}", code="invalid_json") from err


async def _respond(request: Request, job: Job, engine: Engine, loop: EngineLoop) -> Response:
    """Submit ``job`` and answer: a stream of chunks, or the whole response."""
    channel = Channel(asyncio.get_running_loop())
    try:
        ticket = loop.submit(list(zip(job.prompts, job.settings)), channel)
    except QueueFull as err:
        raise APIError(str(err), code="queue_full", status=429, kind="rate_limit_error") from err
    event = await channel.events.get()
    if isinstance(event, Failed):
        raise APIError(event.message, status=event.status, kind=_kind(event.status))
    assert isinstance(event, Admitted)
    builder = ResponseBuilder(job, engine)
    if job.stream:
        return _EventStream(_chunks(builder, channel, job), on_close=lambda: loop.cancel(ticket))
    return await _whole(request, builder, channel, loop, ticket)


def _kind(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _chunks(builder: ResponseBuilder, channel: Channel, job: Job) -> AsyncIterator[str]:
    """The job's server-sent events: its chunks as they come, the usage chunk when asked
    for, an error event if the engine fails a request, and ``data: [DONE]``."""
    for chunk in builder.opening():
        yield _sse(chunk)
    while not builder.finished:
        event = await channel.events.get()
        if isinstance(event, Failed):
            yield _sse(error_body(event.message, kind="server_error", code="engine_error"))
            break
        chunk = builder.feed(event.index, event.output)
        if chunk is not None:
            yield _sse(chunk)
        if event.output.error:
            yield _sse(error_body(event.output.error, kind="server_error", code="engine_error"))
            break
    else:
        if job.include_usage:
            yield _sse(builder.chunk([], usage=builder.usage()))
    yield "data: [DONE]\n\n"


async def _whole(
    request: Request, builder: ResponseBuilder, channel: Channel, loop: EngineLoop, ticket: Ticket
) -> Response:
    """Wait for every choice to finish and answer with the whole response; a client that
    disconnects meanwhile cancels the job."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        loop.cancel(ticket)
        channel.events.put_nowait(Failed("the client disconnected", 499))

    watcher = asyncio.create_task(watch())
    try:
        while not builder.finished:
            event = await channel.events.get()
            if isinstance(event, Failed):
                raise APIError(event.message, status=event.status, kind=_kind(event.status))
            builder.feed(event.index, event.output)
    finally:
        watcher.cancel()
    errors = builder.errors()
    if errors:
        raise APIError("; ".join(errors), status=500, kind="server_error", code="engine_error")
    return JSONResponse(builder.response())


class _EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: finished, failed,
    or cut short by a client that disconnected (Starlette cancels the stream then), so that a
    request nobody reads any more is cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _drained(signum: int, frame: object) -> None:
    raise SystemExit(0 if signum == signal.SIGTERM else 130)


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: Sequence[str],
    chat_template: ChatTemplate | None = None,
    api_key: str | None = None,
    max_queue: int = 256,
    log_level: str = "info",
) -> None:
    """Serve ``engine`` on ``host:port`` until SIGINT or SIGTERM; on either, stop accepting
    connections, let the running requests finish, then return (uvicorn's graceful shutdown).
    On CUDA the engine is warmed up first (:func:`scheduler.warm_up`: every batch bucket's
    graphs captured, every kernel compiled), so the port opens once the first request can be
    served at full speed."""
    import uvicorn

    if engine.device.type == "cuda":
        print("speculum: warming up (CUDA graphs for every batch bucket)", file=sys.stderr)
        scheduler.warm_up(engine)

    if threading.current_thread() is threading.main_thread():
        # Uvicorn re-raises the signal that stopped it once it has drained: exit then, with
        # status 0 for SIGTERM (a requested stop) and 130 for Ctrl-C, without a traceback.
        signal.signal(signal.SIGTERM, _drained)
        signal.signal(signal.SIGINT, _drained)
    app = create_app(
        engine,
        served_model_names=served_model_names,
        chat_template=chat_template,
        api_key=api_key,
        max_queue=max_queue,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
