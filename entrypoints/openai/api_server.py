"""The OpenAI-compatible HTTP server (aiohttp): app factory, routes, auth and error middleware.

Endpoints
  POST /v1/completions, POST /v1/chat/completions   generation, SSE when "stream": true
  GET  /v1/models, GET /v1/models/{model}           the served model name(s)
  POST /tokenize, POST /detokenize                  vLLM's tokenizer endpoints
  GET  /health (200 empty / 503), GET /metrics (Prometheus text), GET /version

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 BadRequestError for
every validation failure (malformed JSON, text that is not valid Unicode, wrong JSON types,
out-of-range values, unknown fields, context overflow, more sequences than one request may start;
vLLM also answers its schema errors with 400, so 422 is never used), 401 missing/wrong API key,
404 unknown model or route, 405 wrong method, 408 body not received in time, 413 body over the
limit (a declared Content-Length over it is refused before reading), 500 internal error, 503
engine dead or its queue full (with Retry-After). The server keeps serving after each.

Security defaults: the CLI binds 127.0.0.1. With an API key (--api-key or HYBRIDKV_API_KEY)
every /v1 route and /tokenize, /detokenize need `Authorization: Bearer <key>` (the scheme in any
case); the routes open without a key are exactly /health, /version and /metrics (/metrics too
needs the key with metrics_require_api_key); unknown paths outside /v1 get 404 either way. Bodies
are capped at max_request_body_bytes; no endpoint runs user code (per-request chat templates are
refused) or reads files.

Slow or greedy clients: a connection must send a request's headers within keepalive_timeout
(counted from connect, or from the end of the previous response; aiohttp arms that timer at
connection start and incoming bytes do not reset it, so trickling a header does not help), and
its body within body_timeout (else 408 and the connection closes); at most max_connections are
open (more are closed as soon as they connect); one request starts at most max_seqs_per_request
sequences (prompts x n), and the engine's bounded queue answers 503 + Retry-After when full.
Tokenizing, chat templating, detokenizing and encoding whole responses run in the app's worker
threads, never on the event loop.

The app owns the AsyncLLMEngine it is given: shutting the app down aborts in-flight requests
(streams end with an error event) and stops the engine thread.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.metadata
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from hybridkv.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from hybridkv.entrypoints.openai.gc_pauses import GcPauses, freeze_startup_heap
from hybridkv.entrypoints.openai.json_body import parse_json_body
from hybridkv.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hybridkv.entrypoints.openai.metrics import ServerMetrics
from hybridkv.entrypoints.openai.http2_probe import Http1Only
from hybridkv.entrypoints.openai.reasoning_parser import check_parser_name as check_reasoning_parser
from hybridkv.entrypoints.openai.tool_parsers import check_parser_name as check_tool_parser
from hybridkv.entrypoints.openai.serving_base import DEFAULT_MAX_SEQS_PER_REQUEST, ServingContext, longest_token_bytes
from hybridkv.entrypoints.openai.serving_chat import ChatServing
from hybridkv.entrypoints.openai.serving_completion import CompletionServing
from hybridkv.entrypoints.openai.serving_native import NativeServing
from hybridkv.entrypoints.openai.serving_tokenization import TokenizationServing
from hybridkv.model_executor.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

API_KEY_ENV = "HYBRIDKV_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # ~1M tokens of JSON token ids; far above any context we serve
DEFAULT_KEEPALIVE_TIMEOUT = 15.0
DEFAULT_BODY_TIMEOUT = 30.0  # 8 MiB in 30 s is ~280 KB/s: only a stalled or hostile client is slower
DEFAULT_MAX_CONNECTIONS = 1024
# Tokenizer work mostly releases the GIL, so two threads overlap two large requests; more would
# only compete with the event loop and the engine thread for the GIL and the cores.
WORKER_THREADS = 2
INLINE_JSON_BYTES = 64 << 10  # smaller bodies parse on the loop: well under a millisecond, no thread hop
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# A dead engine never recovers: the seconds serve() keeps answering 503 before it exits (enough
# for in-flight responses to be written and a health check to see the 503), and how often it looks.
DEAD_ENGINE_EXIT_S = 5.0
ENGINE_WATCH_S = 0.2

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None  # None: the model path (the demo model's name if none)
    api_key: str | None = None  # None: no auth (the CLI binds loopback by default)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    chat_template: str | None = None  # None: the engine config's, then the checkpoint's own
    # Seconds a connection gets to send a request's headers, from connect or from the previous
    # response; also how long an idle keep-alive connection stays open.
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds to receive a whole body, else 408 and close
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections; more are closed on connect
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST  # prompts x n
    metrics_require_api_key: bool = False  # /metrics is open by default (scrapers rarely send keys)
    reasoning_parser: str | None = None  # reasoning_parser.PARSERS: chat outputs split into reasoning and content
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed, its calls parsed with tool_call_parser
    tool_call_parser: str | None = None  # tool_parsers.PARSERS

    def validate(self) -> None:
        for name in ("max_request_body_bytes", "max_connections", "max_seqs_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("keepalive_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.reasoning_parser is not None:
            check_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser is not None:
            check_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")


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
                413: _too_large(request).message,
            }.get(e.status, e.reason)
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return OpenAIError(message, e.status, close_connection=e.status == 413).response(headers)
        except EngineDeadError as e:
            return OpenAIError(f"The engine is not running: {e}", 503).response()
        except Exception as e:  # noqa: BLE001 - never leak a traceback page; keep serving
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return OpenAIError(f"Internal server error: {type(e).__name__}", 500).response()

    return errors


def _auth_middleware(api_key: str, protect_metrics: bool) -> Any:
    expected = api_key.encode("utf-8")

    def protected(path: str) -> bool:
        return path.startswith(_PROTECTED_PREFIXES) or path == "/v1" or (protect_metrics and path == "/metrics")

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if protected(request.path):
            scheme, _, credentials = request.headers.get("Authorization", "").strip().partition(" ")
            if not scheme:
                raise OpenAIError("Missing API key: send it as 'Authorization: Bearer <key>'.", 401)
            if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110, 11.1)
                raise OpenAIError(f"Unsupported authorization scheme '{scheme[:20]}': send the key as "
                                  "'Authorization: Bearer <key>'.", 401)
            # Constant-time comparison: response timing must not reveal the key. aiohttp keeps
            # undecodable header bytes as surrogate escapes; surrogateescape gets them back.
            if not hmac.compare_digest(credentials.strip().encode("utf-8", "surrogateescape"), expected):
                raise OpenAIError("Incorrect API key provided.", 401)
        return await handler(request)

    return auth


# -- routes ---------------------------------------------------------------------------------------
CONTEXT = web.AppKey("hybridkv_context", ServingContext)
SETTINGS = web.AppKey("hybridkv_settings", ServerSettings)


def _too_large(request: web.Request) -> OpenAIError:
    # The rest of the body is not read: the connection cannot carry another request.
    return OpenAIError(f"Request body too large: the limit is {request.app[SETTINGS].max_request_body_bytes} bytes.",
                       413, close_connection=True)


async def read_json(request: web.Request) -> Any:
    settings = request.app[SETTINGS]
    # A declared length over the limit is refused before reading: otherwise the read would wait
    # for bytes that may never come (Content-Length: 9223372036854775807 and a tiny body).
    if request.content_length is not None and request.content_length > settings.max_request_body_bytes:
        raise _too_large(request)
    try:
        raw = await asyncio.wait_for(request.read(), settings.body_timeout)
    except web.HTTPRequestEntityTooLarge as e:  # a chunked body that grew past the limit
        raise _too_large(request) from e
    except asyncio.TimeoutError as e:
        raise OpenAIError(f"The request body was not received within {settings.body_timeout:g} seconds.", 408,
                          close_connection=True) from e
    if not raw or raw.isspace():
        raise bad_request("The request body is empty; send a JSON object.")
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json_body(raw)
    return await request.app[CONTEXT].run(parse_json_body, raw)


class _Routes:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.completions = CompletionServing(ctx)
        self.chat = ChatServing(ctx)
        self.tokenization = TokenizationServing(ctx)
        self.native = NativeServing(ctx)

    async def create_completion(self, request: web.Request) -> web.StreamResponse:
        return await self.completions.create(request, await read_json(request))

    async def create_chat_completion(self, request: web.Request) -> web.StreamResponse:
        return await self.chat.create(request, await read_json(request))

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self.tokenization.tokenize(await read_json(request))

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self.tokenization.detokenize(await read_json(request))

    def _card(self, name: str) -> dict:
        ctx = self.ctx
        # root: the served name, not the checkpoint's path (which would show the server's disk layout).
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "hybridkv",
                "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len, "permission": []}

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

    async def model_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.native.model_info())

    async def server_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.native.server_info())

    async def flush_cache(self, request: web.Request) -> web.StreamResponse:
        return await self.native.flush_cache()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self.native.generate(request, await read_json(request))


def build_app(engine: AsyncLLMEngine, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()
    settings.validate()
    names = list(settings.served_model_names or [default_model_name(engine)])
    defaults = {k: v for k, v in engine.generation_defaults.items() if k in _SAMPLING_DEFAULT_KEYS}
    tokenizer = load_tokenizer(engine.model_dir)  # our own instance; the engine thread uses its own
    # Threads start on first use; app cleanup shuts the pool down.
    executor = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="hybridkv-server")
    gc_pauses = GcPauses()  # timed while the app runs (installed on startup, removed on cleanup)
    ctx = ServingContext(
        engine=engine,
        tokenizer=tokenizer,
        served_model_names=names,
        model_path=engine.model_dir,
        max_model_len=engine.max_model_len,
        chat_template=settings.chat_template or engine.config.chat_template,
        sampling_defaults=defaults,
        metrics=ServerMetrics(names[0], engine.snapshot, limits={
            "max_seqs_per_request": settings.max_seqs_per_request,
            "max_connections": settings.max_connections,
            "max_request_body_bytes": settings.max_request_body_bytes,
        }, gc_pauses=gc_pauses, parallel_layout=engine.parallel_layout),
        executor=executor,
        max_token_bytes=longest_token_bytes(tokenizer),
        max_seqs_per_request=settings.max_seqs_per_request,
        reasoning_parser=settings.reasoning_parser,
        tool_call_parser=settings.tool_call_parser if settings.enable_auto_tool_choice else None,
    )
    middlewares = [_error_middleware()]
    if settings.api_key:
        middlewares.append(_auth_middleware(settings.api_key, settings.metrics_require_api_key))
    app = web.Application(client_max_size=settings.max_request_body_bytes, middlewares=middlewares)
    app[CONTEXT] = ctx
    app[SETTINGS] = settings
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
        # SGLang's native API (serving_native.py): its router's probes, /flush_cache, /generate.
        web.get("/get_model_info", r.model_info),
        web.get("/model_info", r.model_info),
        web.get("/get_server_info", r.server_info),
        web.get("/server_info", r.server_info),
        web.post("/flush_cache", r.flush_cache),
        web.post("/generate", r.generate),
    ])

    async def stop_engine(app: web.Application) -> None:
        # Runs after the listening sockets closed: fail in-flight requests now so their handlers
        # finish (streams end with an error event), then stop the engine thread.
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    async def stop_workers(app: web.Application) -> None:
        # After the handlers are gone; a tokenization still running finishes in its thread.
        shutdown = functools.partial(executor.shutdown, wait=True, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, shutdown)

    async def time_gc(app: web.Application) -> None:
        gc_pauses.install()

    async def stop_timing_gc(app: web.Application) -> None:
        gc_pauses.uninstall()

    app.on_startup.append(time_gc)
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(stop_workers)
    app.on_cleanup.append(stop_timing_gc)
    return app


# -- running ----------------------------------------------------------------------------------------
class _Refused(asyncio.Protocol):
    """A connection over the limit: closed as soon as it is made, before aiohttp sees it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class LimitedTCPSite(web.BaseSite):
    """web.TCPSite with a cap on open connections.

    The protocol factory hands a connection over the cap a protocol that closes it at once. (The
    obvious alternative, handler.force_close() on aiohttp's new handler, does nothing before
    connection_made, and the connection then hangs open.) The count is the runner's live
    connections; connections accepted in the same loop iteration all see the same count, so a
    burst can overshoot by at most one accept batch (the listen backlog).
    """

    _WARN_EVERY_S = 60.0  # a flood must not flood the log too

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._max_connections = host, port, max_connections
        self._last_warning = -self._WARN_EVERY_S

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()  # registers the site with the runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) < self._max_connections:
                return Http1Only(server())
            if loop.time() - self._last_warning >= self._WARN_EVERY_S:
                self._last_warning = loop.time()
                logger.warning("refusing connections: %d are open (max_connections)", self._max_connections)
            return _Refused()

        self._server = await loop.create_server(protocol, self._host, self._port, backlog=self._backlog)


async def start_server(
    app: web.Application, host: str, port: int, *, access_log: bool = True, shutdown_timeout: float = 10.0
) -> tuple[web.AppRunner, int]:
    """Start serving app; returns the runner (call `cleanup()` to stop) and the bound port (port 0 = any free)."""
    settings = app[SETTINGS]
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests, for non-streaming requests too (aiohttp >= 3.9 no longer does this by default).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=settings.keepalive_timeout,
    )
    await runner.setup()
    site = LimitedTCPSite(runner, host, port, settings.max_connections)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return runner, bound


async def serve(
    engine: AsyncLLMEngine, settings: ServerSettings, host: str, port: int, *, access_log: bool = True,
    on_ready: Callable[[int], None] | None = None, dead_engine_exit_s: float = DEAD_ENGINE_EXIT_S,
) -> int:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (in-flight requests are aborted):
    the exit status is 0. An engine that dies (a lost tensor-parallel rank, a failed step) never
    recovers: the server answers 503 for dead_engine_exit_s more seconds (the in-flight requests
    get their errors, health checks see it) and then stops, the exit status 1, so whatever
    supervises the process can restart it."""
    app = build_app(engine, settings)
    # This process is the server: what it loaded to get here lives as long as it does, so no
    # collection should walk it again (gc_pauses.py: a full collection of it is ~0.3 s). Before
    # the app starts, so its own collection is not counted as a pause of the running server.
    logger.info("froze %d startup objects out of garbage collection", freeze_startup_heap())
    runner, bound = await start_server(app, host, port, access_log=access_log)
    stop = asyncio.Event()
    died: list[BaseException | None] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def stop_when_the_engine_dies() -> None:
        while not engine.errored:
            await asyncio.sleep(ENGINE_WATCH_S)
        logger.error("the engine died: %s; answering 503 for %gs, then exiting", engine.dead_error,
                     dead_engine_exit_s)
        await asyncio.sleep(dead_engine_exit_s)
        died.append(engine.dead_error)
        stop.set()

    watcher = asyncio.create_task(stop_when_the_engine_dies())
    if on_ready is not None:
        on_ready(bound)
    try:
        await stop.wait()
        if died:
            logger.error("exiting because the engine died: %s", died[0])
        else:
            logger.info("shutting down: aborting in-flight requests and stopping the engine")
    finally:
        watcher.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        engine.shutdown()  # no-op when on_shutdown already stopped it
    return 1 if died else 0
