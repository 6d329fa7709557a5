"""The OpenAI-compatible HTTP server (aiohttp): app factory, routes, auth and error middleware.

Endpoints
  POST /v1/completions, POST /v1/chat/completions   generation, SSE when "stream": true
  GET  /v1/models, GET /v1/models/{model}           the served model name(s)
  POST /tokenize, POST /detokenize                  vLLM's tokenizer endpoints
  GET  /health (200 empty / 503), GET /metrics (Prometheus text), GET /version

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 BadRequestError for
every validation failure (malformed JSON, wrong JSON types, out-of-range values, unknown fields,
context overflow; vLLM also answers its schema errors with 400, so 422 is never used),
401 missing/wrong API key, 404 unknown model or route, 405 wrong method, 413 body over the limit,
500 internal error, 503 engine dead. The server keeps serving after each.

Security defaults: the CLI binds 127.0.0.1; with an API key (--api-key or HYBRIDKV_API_KEY) every
/v1 route and /tokenize, /detokenize need `Authorization: Bearer <key>`; bodies are capped at
max_request_body_bytes; no endpoint runs user code (per-request chat templates are refused) or
reads files.

The app owns the AsyncLLMEngine it is given: shutting the app down aborts in-flight requests
(streams end with an error event) and stops the engine thread.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from hybridkv.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from hybridkv.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hybridkv.entrypoints.openai.metrics import ServerMetrics
from hybridkv.entrypoints.openai.serving_base import ServingContext
from hybridkv.entrypoints.openai.serving_chat import ChatServing
from hybridkv.entrypoints.openai.serving_completion import CompletionServing
from hybridkv.entrypoints.openai.serving_tokenization import TokenizationServing
from hybridkv.model_executor.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

API_KEY_ENV = "HYBRIDKV_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # ~1M tokens of JSON token ids; far above any context we serve
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None  # None: the model path (the demo model's name if none)
    api_key: str | None = None  # None: no auth (the CLI binds loopback by default)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    chat_template: str | None = None  # None: the engine config's, then the checkpoint's own


def server_version() -> str:
    try:
        return importlib.metadata.version("hybridkv")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout
        return "0.1.0"


def default_model_name(engine: AsyncLLMEngine) -> str:
    return engine.config.model or os.path.basename(os.path.normpath(engine.model_dir))


# -- middleware ------------------------------------------------------------------------------------
def _error_middleware() -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = {
                404: f"Not Found: {request.path}",
                405: f"Method {request.method} is not allowed for {request.path}.",
                413: f"Request body too large: the limit is {request.app[MAX_BODY]} bytes.",
            }.get(e.status, e.reason)
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return OpenAIError(message, e.status).response(headers)
        except EngineDeadError as e:
            return OpenAIError(f"The engine is not running: {e}", 503).response()
        except Exception as e:  # noqa: BLE001 - never leak a traceback page; keep serving
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return OpenAIError(f"Internal server error: {type(e).__name__}", 500).response()

    return errors


def _auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(_PROTECTED_PREFIXES) or request.path == "/v1":
            header = request.headers.get("Authorization")
            if not header:
                raise OpenAIError("Missing API key: send it as 'Authorization: Bearer <key>'.", 401)
            # Constant-time comparison: response timing must not reveal the key.
            if not hmac.compare_digest(header.encode(), expected):
                raise OpenAIError("Incorrect API key provided.", 401)
        return await handler(request)

    return auth


# -- routes ---------------------------------------------------------------------------------------
CONTEXT = web.AppKey("hybridkv_context", ServingContext)
MAX_BODY = web.AppKey("hybridkv_max_body", int)


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise OpenAIError(f"Request body too large: the limit is {request.app[MAX_BODY]} bytes.", 413) from e
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")

    def reject_constant(name: str) -> Any:  # NaN / Infinity are not JSON
        raise ValueError(f"invalid JSON constant {name}")

    try:
        return json.loads(raw, parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}") from e


class _Routes:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.completions = CompletionServing(ctx)
        self.chat = ChatServing(ctx)
        self.tokenization = TokenizationServing(ctx)

    async def create_completion(self, request: web.Request) -> web.StreamResponse:
        return await self.completions.create(request, await read_json(request))

    async def create_chat_completion(self, request: web.Request) -> web.StreamResponse:
        return await self.chat.create(request, await read_json(request))

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.tokenization.tokenize(await read_json(request)))

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.tokenization.detokenize(await read_json(request)))

    def _card(self, name: str) -> dict:
        ctx = self.ctx
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "hybridkv",
                "root": ctx.model_path, "parent": None, "max_model_len": ctx.max_model_len, "permission": []}

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [self._card(n) for n in self.ctx.served_model_names]})

    async def retrieve_model(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name not in self.ctx.served_model_names:
            raise not_found(f"The model `{name}` does not exist.", "model")
        return web.json_response(self._card(name))

    async def health(self, request: web.Request) -> web.StreamResponse:
        engine = self.ctx.engine
        if engine.is_healthy:
            return web.Response(status=200)
        reason = f"engine died: {engine.dead_error!r}" if engine.errored else "engine is not running"
        return OpenAIError(f"Unhealthy: {reason}", 503).response()

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.ctx.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def version(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": server_version()})


def build_app(engine: AsyncLLMEngine, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()
    if settings.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {settings.max_request_body_bytes}")
    names = list(settings.served_model_names or [default_model_name(engine)])
    defaults = {k: v for k, v in engine.generation_defaults.items() if k in _SAMPLING_DEFAULT_KEYS}
    ctx = ServingContext(
        engine=engine,
        tokenizer=load_tokenizer(engine.model_dir),  # our own instance; the engine thread uses its own
        served_model_names=names,
        model_path=engine.model_dir,
        max_model_len=engine.max_model_len,
        chat_template=settings.chat_template or engine.config.chat_template,
        sampling_defaults=defaults,
        metrics=ServerMetrics(names[0], engine.snapshot),
    )
    middlewares = [_error_middleware()]
    if settings.api_key:
        middlewares.append(_auth_middleware(settings.api_key))
    app = web.Application(client_max_size=settings.max_request_body_bytes, middlewares=middlewares)
    app[CONTEXT] = ctx
    app[MAX_BODY] = settings.max_request_body_bytes
    r = _Routes(ctx)
    app.add_routes([
        web.post("/v1/completions", r.create_completion),
        web.post("/v1/chat/completions", r.create_chat_completion),
        web.get("/v1/models", r.list_models),
        web.get("/v1/models/{model:.+}", r.retrieve_model),
        web.post("/tokenize", r.tokenize),
        web.post("/detokenize", r.detokenize),
        web.get("/health", r.health),
        web.get("/metrics", r.metrics),
        web.get("/version", r.version),
    ])

    async def stop_engine(app: web.Application) -> None:
        # Runs after the listening sockets closed: fail in-flight requests now so their handlers
        # finish (streams end with an error event), then stop the engine thread.
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app.on_shutdown.append(stop_engine)
    return app


# -- running ----------------------------------------------------------------------------------------
async def start_server(
    app: web.Application, host: str, port: int, *, access_log: bool = True, shutdown_timeout: float = 10.0
) -> tuple[web.AppRunner, int]:
    """Start serving app; returns the runner (call `cleanup()` to stop) and the bound port (port 0 = any free)."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests, for non-streaming requests too (aiohttp >= 3.9 no longer does this by default).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        shutdown_timeout=shutdown_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return runner, bound


async def serve(
    engine: AsyncLLMEngine, settings: ServerSettings, host: str, port: int, *, access_log: bool = True,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (in-flight requests are aborted)."""
    app = build_app(engine, settings)
    runner, bound = await start_server(app, host, port, access_log=access_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(bound)
    try:
        await stop.wait()
        logger.info("shutting down: aborting in-flight requests and stopping the engine")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        engine.shutdown()  # no-op when on_shutdown already stopped it
