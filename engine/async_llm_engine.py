"""AsyncLLMEngine: an LLMEngine driven by a thread of its own, streaming outputs to asyncio callers.

Why a thread: a forward pass takes milliseconds to seconds; run on the server's event loop it would
stall every other connection (health checks, new requests, other streams). The engine thread owns
the LLMEngine outright: no other thread touches it. Callers talk to it through a thread-safe
command queue (add / abort / call / stop); the thread hands outputs back with
`loop.call_soon_threadsafe`, one callback per loop per step, into per-request asyncio queues.
torch releases the GIL inside its kernels, so the event loop keeps running during a forward.

Lifecycle of a request: `add_requests()` validates on the engine thread (a ValueError comes back
before any output), then the caller iterates a `RequestStream`. Leaving the iteration early
(break, exception, task cancelled, generator closed) aborts whatever has not finished, which
frees its pages. A fatal error inside `step()` fails every in-flight request with
`EngineDeadError`, marks the engine dead (`errored`, `is_healthy`), and from then on new requests
fail at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.decode_burst import burst_limit
from hybridkv.engine.llm_engine import LLMEngine, PromptType
from hybridkv.engine.outputs import RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.structured_output import StructuredOutputStats

logger = logging.getLogger(__name__)

T = TypeVar("T")


WORKER_CHECK_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread failed (or was shut down); in-flight and new requests cannot complete."""


class RequestAbortedError(RuntimeError):
    """Raised in a stream whose request was aborted by someone other than its own consumer."""


class EngineQueueFullError(RuntimeError):
    """add_requests() refused: the waiting queue already holds `max_queued_requests` sequences.

    The server answers 503 with `Retry-After: retry_after` (seconds); nothing was added."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# -- snapshot for metrics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SpaceUsage:
    num_pages: int
    num_free: int
    num_cached: int
    num_in_use: int
    bytes_per_page: int

    @property
    def usage(self) -> float:
        """Fraction of pages held by requests (cached-but-idle pages are reclaimable, so not counted)."""
        return self.num_in_use / self.num_pages if self.num_pages else 0.0

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent view of the engine's counters, taken on the engine thread between steps.

    Readers on other threads get the whole object by one attribute read, so they never see a
    half-updated state and never block the engine.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0  # user requests (an n=2 request counts once)
    spaces: dict[str, SpaceUsage] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens served from it
    prefix_cache_hits_per_space: dict[str, int] = field(default_factory=dict)  # tokens each space served
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    page_size: int = 0  # tokens per page, shared by all spaces
    num_lock_receipts: int = 0  # prefix-cache locks held by requests (0 when idle)
    # Admission (AsyncLLMEngine): the waiting-queue limit in sequences, and adds it refused.
    max_queued_requests: int | None = None
    num_rejected_queue_full: int = 0
    # Host tier (HiCache L2), when enabled: space -> (host pages used, host pages), and counters.
    host_pages: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefix_cache_hits_host: int = 0  # prompt tokens loaded back from the host
    load_back_bytes: int = 0
    write_back_bytes: int = 0
    tier_transfer_seconds: float = 0.0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    # Storage tier (HiCache L3), when enabled: the backend's and the controller's counters.
    storage: dict[str, float] = field(default_factory=dict)
    # HiSparse, when enabled: hot-buffer lookups / hits / loads, rows held, mirror pages.
    hisparse: dict[str, float] = field(default_factory=dict)
    # Speculative decoding, when enabled: the engine's spec_* counters (engine/speculative/verifier.py).
    speculative: dict = field(default_factory=dict)
    # Bytes allocated for the KV cache: tier ("device" / "host") -> space -> bytes (fixed at start).
    kv_cache_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # Structured outputs: constrained requests, grammar compiles (count, seconds), cache hits.
    structured_outputs: StructuredOutputStats = field(default_factory=StructuredOutputStats)

    @classmethod
    def capture(cls, engine: LLMEngine) -> "EngineSnapshot":
        kv = engine.kv
        page = kv.page_size
        spaces = {
            name: SpaceUsage(s.num_pages, s.num_free, s.num_cached, s.num_in_use, kv.specs[name].bytes_per_page(page))
            for name, s in kv.spaces.items()
        }
        return cls(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            num_unfinished_requests=engine.get_num_unfinished_requests(),
            spaces=spaces,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            prefix_cache_hits_per_space=dict(kv.prefix_hits_per_space),
            num_preemptions=engine.scheduler.num_preemptions,
            prompt_tokens=engine.stats.get("prompt_tokens", 0),
            generation_tokens=engine.stats.get("generation_tokens", 0),
            num_steps=engine.stats.get("steps", 0),
            page_size=page,
            num_lock_receipts=kv.index.num_live_receipts if kv.index is not None else 0,
            host_pages=kv.host_tier.usage() if kv.host_tier is not None else {},
            prefix_cache_hits_host=kv.prefix_hits_host,
            load_back_bytes=engine.tier_stats["load_back_bytes"],
            write_back_bytes=engine.tier_stats["write_back_bytes"],
            tier_transfer_seconds=engine.tier_stats["transfer_seconds"],
            num_swap_outs=kv.num_swap_outs,
            num_swap_ins=engine.scheduler.num_swap_ins,
            storage=engine.storage.snapshot() if engine.storage is not None else {},
            hisparse=engine.hisparse_stats(),
            kv_cache_bytes=engine.kv_cache_bytes,
            speculative={k: v for k, v in engine.stats.items() if k.startswith("spec_")},
            structured_outputs=engine.structured.stats(),
        )


# -- requests and their output streams -------------------------------------------------------------
@dataclass
class GenerateRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    cache_salt: str | None = None
    interactive: bool = True  # a client watches its tokens arrive (see LLMEngine.add_request)


_Item = RequestOutput | BaseException


@dataclass(eq=False)
class _Sink:
    """Where the engine thread delivers one request's outputs: an asyncio queue on its loop."""

    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[_Item]"


class RequestStream:
    """Async iterator over the outputs of requests added together (one prompt, or a batch).

    Outputs of different requests interleave in engine order; each carries its request_id.
    Iteration ends once every request has delivered its finished output. `abort()` (also run by
    `aclose()` and by leaving an `async with` block) aborts the requests that have not finished.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: Sequence[str], sink: _Sink) -> None:
        self._engine = engine
        self._sink = sink
        self._pending = set(request_ids)
        self.request_ids = list(request_ids)

    @property
    def finished(self) -> bool:
        return not self._pending

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._pending.clear()  # the engine already dropped these requests
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Abort every request of this stream that has not finished (no-op when all have)."""
        for rid in self._pending:
            self._engine.abort(rid)
        self._pending.clear()

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


# -- engine-thread commands -----------------------------------------------------------------------
@dataclass
class _Add:
    requests: list[GenerateRequest]
    sink: _Sink
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str | None  # None = every in-flight request


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


class AsyncLLMEngine:
    """Runs `engine` on a background thread; all public methods are safe from any thread/loop."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None) -> None:
        """max_queued_requests: most sequences (prompts x n) that may wait for admission; an add
        that would go past it fails with EngineQueueFullError (None = unbounded). An add into an
        empty queue always goes through, so a request within the per-request limits is never
        refused forever."""
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        # A server streams: bursts only where the config asks for them (engine/decode_burst.py).
        engine.burst_limit = burst_limit(engine.config.num_scheduler_steps, engine.config.target_step_seconds,
                                         streaming=True)
        self.num_rejected_queue_full = 0  # engine thread writes, metrics read (an int: atomic)
        self.engine = engine  # owned by the engine thread from here on; use call() to inspect it
        self.tokenizer = engine.tokenizer  # read-only use (encode/decode) is safe across threads
        self.max_model_len = engine.max_model_len
        self.config = engine.config
        self.model_dir = engine.model_dir
        self.parallel_layout = engine.parallel_layout()  # fixed for the engine's life
        # The checkpoint's generation_config sampling defaults (read-only after init).
        self.generation_defaults: dict[str, Any] = dict(engine.generation_defaults.defaults)
        self._commands: "queue.SimpleQueue[_Command]" = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._dead_error: BaseException | None = None
        self._stopping = False
        # Idle, the engine thread wakes this often to look at its tensor-parallel workers (one
        # process: it sleeps until a command comes).
        self._idle_wake_s = WORKER_CHECK_S if engine.config.tensor_parallel_size > 1 else None
        self._snapshot = EngineSnapshot.capture(engine)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_queued_requests: int | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine(config), max_queued_requests)

    # -- health ------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def is_healthy(self) -> bool:
        return self.is_running and not self.errored

    def check_health(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"engine died: {self._dead_error!r}") from self._dead_error
        if not self.is_running:
            raise EngineDeadError("engine is shut down")

    def snapshot(self) -> EngineSnapshot:
        """The engine thread's last snapshot, with the grammar compiler's counters read now: a
        spec refused with a 400 is compiled (and counted) off the engine thread, with no step
        after it to publish it. (Plain counters: reading them here needs no lock.)"""
        return dataclasses.replace(self._snapshot, structured_outputs=self.engine.structured.stats())

    # -- requests ----------------------------------------------------------------------------------
    async def add_requests(self, requests: Sequence[GenerateRequest]) -> RequestStream:
        """Add requests atomically (all or none); raises ValueError from validation before any output."""
        self.check_health()
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(list(requests), sink, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The add may still go through after we stop waiting: abort (commands run in order).
            for r in requests:
                self.abort(r.request_id)
            raise
        return RequestStream(self, [r.request_id for r in requests], sink)

    async def check_structured_outputs(self, params: Sequence[SamplingParams]) -> None:
        """Compile the constraints of these params (on the grammar worker, cached) and wait for
        them without blocking the loop: a ValueError names the first that cannot be compiled.
        Safe off the engine thread (the compiler is thread-safe), so a bad grammar is refused
        before anything is added."""
        specs = [p.structured_outputs for p in params if p.structured_outputs is not None]
        for fut in self.engine.structured.compile_all(specs):
            await asyncio.wrap_future(fut)

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, cache_salt: str | None = None
    ) -> RequestStream:
        return await self.add_requests([GenerateRequest(request_id, prompt, params, cache_salt)])

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, *, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (DELTA or CUMULATIVE per params.output_kind); dropping the iterator aborts it."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:  # GeneratorExit, CancelledError, or a consumer exception: free the pages now
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        self._commands.put(_Abort(None))

    # -- running code on the engine thread (introspection, tests) -----------------------------------
    def call_threadsafe(self, fn: Callable[[LLMEngine], T]) -> "concurrent.futures.Future[T]":
        """Run fn(engine) on the engine thread between two steps; the only safe way to touch it."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():  # nobody else touches the engine any more: run here
            try:
                done.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)
            return done
        self._commands.put(_Call(fn, done))
        return done

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def check_idle(self, timeout: float = 10.0) -> None:
        """Blocking (not on the engine's callers' loop): wait until no request is left, then check
        on the engine thread that every page is free or cached (`kv.assert_idle`)."""
        import time

        deadline = time.monotonic() + timeout
        while self.call_threadsafe(lambda e: e.has_unfinished_requests()).result(timeout):
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still has unfinished requests after {timeout}s: {self.snapshot()}")
            time.sleep(0.01)
        self.call_threadsafe(lambda e: e.kv.assert_idle()).result(timeout)

    async def wait_until_idle(self, timeout: float = 10.0) -> None:
        """Async twin of check_idle()."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while await self.call(lambda e: e.has_unfinished_requests()):
            if loop.time() > deadline:
                raise AssertionError(f"engine still has unfinished requests after {timeout}s: {self.snapshot()}")
            await asyncio.sleep(0.01)
        await self.call(lambda e: e.kv.assert_idle())

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort in-flight requests (their streams fail with EngineDeadError) and join the thread."""
        if self._thread.is_alive():
            self._stopping = True
            self._commands.put(_Stop())
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._settle_leftovers()

    def _settle_leftovers(self) -> None:
        """Commands that raced with the stop: nobody will process them on the engine thread, and
        their callers would wait forever. The thread is gone, so running them here is safe."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError("the engine was shut down"))
            elif isinstance(cmd, _Call):
                self._handle(cmd)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = self._dead_error is None and engine.has_unfinished_requests()
            commands = self._drain(block=not busy)
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._fail_all(EngineDeadError("the engine was shut down"))
                    self._publish()
                    self._stop_workers()
                    return  # commands queued behind the stop are settled by shutdown()
                self._handle(cmd)
            if commands:
                self._publish()  # new/aborted requests show in the metrics before a long step starts
            if self._dead_error is not None or not engine.has_unfinished_requests():
                if not commands and self._dead_error is None:  # woken idle: are the workers still there?
                    self._check_workers()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - any step failure leaves the engine unusable
                logger.exception("engine step failed; failing all requests")
                self._dead_error = e
                self._fail_all(EngineDeadError(f"engine step failed: {e!r}"))
                self._publish()
                continue
            # Publish first: a client that reads /metrics right after its last token must see
            # the step that produced it.
            self._publish()
            self._deliver(outputs)

    def _check_workers(self) -> None:
        """An idle engine learns of a lost tensor-parallel worker here, not at the next request:
        it dies now, so /health answers 503 and a server exits for its supervisor to restart."""
        try:
            self.engine.check_workers()
        except Exception as e:  # noqa: BLE001 - the engine cannot continue without the rank
            logger.error("the engine lost a tensor-parallel worker while idle: %s", e)
            self._dead_error = e
            self._fail_all(EngineDeadError(f"engine died: {e!r}"))
            self._publish()

    def _stop_workers(self) -> None:
        """Tell tensor-parallel workers to stop (a no-op in one process), from the thread that
        ran their collectives: a clean stop, so the workers of other nodes exit 0 too, rather
        than being cut off when this process exits."""
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - the workers are killed at exit anyway
            logger.exception("stopping the tensor-parallel workers failed")

    def _drain(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_wake_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, cmd: _Command) -> None:
        engine = self.engine
        if isinstance(cmd, _Abort):
            ids = list(self._sinks) if cmd.request_id is None else [cmd.request_id]
            for rid in ids:
                sink = self._sinks.pop(rid, None)
                engine.abort_request(rid)  # a no-op for unknown or finished ids
                if sink is not None:
                    # Wake a consumer still waiting (when it aborted itself, it no longer reads).
                    self._post(sink.loop, [(sink.queue, RequestAbortedError(f"request {rid} was aborted"))])
        elif isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn(engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    cmd.done.set_exception(e)
        elif isinstance(cmd, _Add):
            if not cmd.done.set_running_or_notify_cancel():
                return  # the caller gave up waiting (cancelled) before we got here: add nothing
            if self._dead_error is not None:
                cmd.done.set_exception(EngineDeadError(f"engine died: {self._dead_error!r}"))
                return
            waiting = engine.scheduler.num_waiting
            new = sum(r.params.n for r in cmd.requests)
            limit = self.max_queued_requests
            if limit is not None and waiting and waiting + new > limit:
                self.num_rejected_queue_full += 1
                cmd.done.set_exception(EngineQueueFullError(
                    f"The server is overloaded: {waiting} sequences are waiting and this request adds {new} "
                    f"(the limit is {limit}); retry later."))
                return
            # One fairness key per add (one client request, however many prompts and samples):
            # admission takes waiting sequences round-robin across keys.
            client = cmd.requests[0].request_id if cmd.requests else None
            added: list[str] = []
            try:
                for r in cmd.requests:
                    if r.request_id in self._sinks:
                        raise ValueError(f"request id {r.request_id!r} is already in use")
                    engine.add_request(r.request_id, r.prompt, r.params, r.cache_salt, client_id=client,
                                       interactive=r.interactive)
                    self._sinks[r.request_id] = cmd.sink
                    added.append(r.request_id)
            except Exception as e:  # noqa: BLE001 - validation errors go back to the caller
                for rid in added:  # all or none: a batch with one bad prompt adds nothing
                    self._sinks.pop(rid, None)
                    engine.abort_request(rid)
                cmd.done.set_exception(e)
            else:
                cmd.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, _Item]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted after this step was scheduled
                continue
            if out.finished:
                del self._sinks[out.request_id]
            by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in by_loop.items():
            self._post(loop, items)

    def _post(self, loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, _Item]]) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody will read these, stop generating
            for _, item in items:
                if isinstance(item, RequestOutput) and not item.finished:
                    self._sinks.pop(item.request_id, None)
                    self.engine.abort_request(item.request_id)

    def _fail_all(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, _Item]]] = {}
        seen: set[int] = set()
        for rid, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(rid)  # best effort: frees pages unless the engine is broken
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed while failing all requests", rid)
            if id(sink) not in seen:  # one error per stream, even for a batch of requests
                seen.add(id(sink))
                by_loop.setdefault(sink.loop, []).append((sink.queue, error))
        self._sinks.clear()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass

    def _publish(self) -> None:
        try:
            self._snapshot = dataclasses.replace(
                EngineSnapshot.capture(self.engine), max_queued_requests=self.max_queued_requests,
                num_rejected_queue_full=self.num_rejected_queue_full,
            )
        except Exception:  # noqa: BLE001 - metrics must never take the engine down
            logger.exception("could not capture engine snapshot")


def _put_all(items: list[tuple[asyncio.Queue, _Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)
