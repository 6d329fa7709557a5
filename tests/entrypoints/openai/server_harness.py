"""Test harness: a real OpenAI-compatible server on a free loopback port, in a background thread
running its own event loop, plus raw-HTTP and SSE helpers."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import openai

from hybridkv.engine.async_llm_engine import AsyncLLMEngine
from hybridkv.engine.config import EngineConfig
from hybridkv.entrypoints.openai.api_server import ServerSettings, build_app, start_server

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256


@dataclass
class ServerHandle:
    engine: AsyncLLMEngine
    api_key: str | None
    port: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None
    _runner: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=60, **kwargs)

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                auth: bool = True, timeout: float = 60) -> tuple[int, dict, bytes]:
        """Raw HTTP (bodies may be bytes, to send malformed JSON); returns status, headers, body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        hdrs = {"Content-Type": "application/json"}
        if auth and self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        hdrs.update(headers or {})
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def start(self, settings: ServerSettings) -> "ServerHandle":
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)

            async def up() -> None:
                app = build_app(self.engine, settings)
                self._runner, self.port = await start_server(app, "127.0.0.1", 0, access_log=False,
                                                             shutdown_timeout=5)

            try:
                self._loop.run_until_complete(up())
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="test-server", daemon=True)
        self._thread.start()
        ready.wait(60)
        if failure:
            raise failure[0]
        return self

    def run_coro(self, coro, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def open_connections(self) -> int:
        """How many connections the server holds open right now (read on its loop)."""
        async def count() -> int:
            return len(self._runner.server.connections)

        return self.run_coro(count())

    def stop(self) -> None:
        """Idempotent: stops the app (aborting in-flight requests), the loop thread and the engine."""
        if self._loop.is_closed():
            return
        if self._runner is not None:
            self.run_coro(self._runner.cleanup())  # aborts in-flight requests, stops the engine thread
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop.close()
        self.engine.shutdown()


def launch(ckpt: str, *, api_key: str | None = API_KEY, served_model_names: list[str] | None = None,
           max_request_body_bytes: int = 1 << 20, max_queued_requests: int | None = None,
           settings: dict[str, Any] | None = None, **engine_kwargs) -> ServerHandle:
    """engine_kwargs go to EngineConfig, `settings` to ServerSettings (keepalive_timeout, ...)."""
    cfg = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    cfg.update(engine_kwargs)
    engine = AsyncLLMEngine.from_config(EngineConfig(model=ckpt, **cfg), max_queued_requests=max_queued_requests)
    try:
        server_settings = ServerSettings(served_model_names=served_model_names or [MODEL], api_key=api_key,
                                         max_request_body_bytes=max_request_body_bytes, **(settings or {}))
        return ServerHandle(engine, api_key).start(server_settings)
    except BaseException:
        engine.shutdown()
        raise


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its `data:` payloads, checking OpenAI's exact framing on the way."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), "an SSE stream ends with a blank line"
    events = text[:-2].split("\n\n")
    out = []
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, f"not a single-line data event: {e!r}"
        out.append(e[len("data: "):])
    return out
