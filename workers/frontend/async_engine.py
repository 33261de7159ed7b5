"""AsyncEngine: asyncio streams in front of an engine core that steps on its own.

The core is either a thread of this process that owns the LLMEngine
(`workers.frontend.engine_thread.EngineThread`, the default) or a child process
(`workers.frontend.engine_process.EngineProcess`, `process=True`), which keeps the step loop off
this
interpreter's GIL: what a server wants. Either way callers talk to the core through commands,
and each request's outputs flow back through an asyncio.Queue on the caller's event loop. If
the core fails, the engine is dead: every waiting caller gets EngineDeadError at once, and so
does every later call — nobody hangs.

A stream yields what the request's `SamplingParams.output_kind` asks for (see
`workers.outputs`): deltas while it runs (DELTA), or only the finished output (FINAL_ONLY);
the finished output carries everything. Both cores give the same outputs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from workers.config import EngineArgs, EngineConfig
from workers.core.engine import LLMEngine
from workers.core.kv_events import KvEvent
from workers.core.stats import EngineStats
from workers.errors import EngineDeadError
from workers.frontend.engine_core import EngineCore
from workers.frontend.engine_thread import EngineThread
from workers.inputs import EngineInput
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams

_Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs | EngineConfig,
        engine: LLMEngine | None = None,
        *,
        process: bool = False,
    ) -> None:
        def config() -> EngineConfig:
            return args.create_config() if isinstance(args, EngineArgs) else args

        # The engine's config, as this process built it (the child builds its own from the same
        # arguments): what it serves, for the model card.
        self.config: EngineConfig = engine.config if engine is not None else config()
        if process:
            from workers.frontend.engine_process import EngineProcess

            if engine is not None:
                raise ValueError("process=True builds its engine in the child; pass no engine")
            self._core: EngineCore = EngineProcess(self.config)
        else:
            self._core = EngineThread(engine or LLMEngine(self.config))
        self.tokenizer = self._core.tokenizer
        self.model_name = self._core.model_name
        self.max_model_len = self._core.max_model_len
        self.input_checker = self._core.input_checker
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        # Called on the core's thread with each step's KV events (workers/core/kv_events.py) when
        # the engine records them (EngineArgs.kv_events): a KV-aware router's feed.
        self.kv_listener: Callable[[tuple[KvEvent, ...]], None] | None = None
        self._core.start(self)

    @classmethod
    def from_args(cls, **kwargs: Any) -> AsyncEngine:
        return cls(EngineArgs(**kwargs))

    # -- public API ---------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine | None:
        """The LLMEngine when it runs in this process (thread core), else None."""
        return getattr(self._core, "engine", None)

    @property
    def in_process(self) -> bool:
        return isinstance(self._core, EngineThread)

    @property
    def engine_pid(self) -> int | None:
        """The engine child's process id (a process core), else None: what fault tests and
        `kvray bench serve --fault-at` kill."""
        return getattr(self._core, "pid", None)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._core.is_alive()

    def check_progress(self) -> None:
        """Cheap and never blocking (no round trip to the ranks): EngineDeadError when the
        engine is dead or has work pending and completed no step in `step_timeout_s`."""
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        self._core.check_progress()

    def check_health(self) -> None:
        """`check_progress`, then the full check: for TP > 1 a blocking ping of every rank,
        so call it off an event loop (a health hook, not per request)."""
        self.check_progress()
        self._core.check_health()

    def stats(self) -> EngineStats:
        return self._core.stats()

    def pop_step_token_counts(self) -> list[int]:
        return self._core.pop_step_token_counts()

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Checks the prompt (text or token ids) and params with `input_checker`, then streams
        like `generate_input`. Bad input raises ValueError before the first output.
        `priority`: lower is more urgent (workers/core/scheduler.py)."""
        return self._stream(request_id, prompt=prompt, params=params, priority=priority)

    def generate_input(
        self, inp: EngineInput, request_id: str, queue_timeout_s: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams the RequestOutputs of a checked request (the kind its params ask for); the
        last has finished=True. `inp` is trusted: check it with `input_checker` first.

        A request no engine step has taken within `queue_timeout_s` ends unrun: its one
        output is finished and `workers.outputs.is_queue_timeout` says so."""
        return self._stream(request_id, inp=inp, queue_timeout_s=queue_timeout_s)

    async def _stream(
        self,
        request_id: str | None,
        inp: EngineInput | None = None,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        queue_timeout_s: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        # One generator behind both entry points: checks run on the first iteration, so a
        # caller sees every error where it reads the stream. Only the cheap local check: a
        # blocking ping of the ranks here would stall every stream on this event loop.
        self.check_progress()
        if inp is None:
            inp = self.input_checker.check_prompt(
                prompt,  # type: ignore[arg-type]
                params,  # type: ignore[arg-type]
                self.tokenizer,
                priority=priority,
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        # Registered before the core sees the request, so no output can miss its stream.
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            if self._dead is not None:  # lost the race with a failure
                raise EngineDeadError(f"engine failed: {self._dead}")
            self._core.add(request_id, inp, queue_timeout_s)
            inp = None  # the core has it: pulled KV blocks (EngineInput.kv_blocks) go with it
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # a rejected or failed request holds nothing in the core
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or closed early: free the request's blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            try:
                self._core.abort(request_id)
            except EngineDeadError:
                pass  # the failure reaches every caller through failed()

    def shutdown(self) -> None:
        self._core.shutdown()

    # -- the sink: called on the core's thread ------------------------------------------------
    def outputs(self, outs: list[RequestOutput]) -> None:
        # One hand-over per caller loop per step, not one per request: each
        # call_soon_threadsafe writes the loop's self-pipe, so this is one wake-up per step
        # however many streams (no throughput change measured on the demo model).
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if out.finished:
                    # pop, not del: the caller's loop may be dropping the stream right now.
                    self._streams.pop(out.request_id, None)
                batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            _deliver_many(loop, items)

    def kv_events(self, events: tuple[KvEvent, ...]) -> None:
        listener = self.kv_listener
        if listener is not None:
            listener(events)

    def rejected(self, request_id: str, err: Exception) -> None:
        """The core refused the request (ValueError: bad input); its caller gets `err`."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            _deliver_many(stream[0], [(stream[1], err)])

    def failed(self, cause: BaseException) -> None:
        self._dead = cause  # first, so a stream registered from now on sees it
        err = EngineDeadError(f"engine failed: {cause}")
        for rid in list(self._streams):
            stream = self._streams.pop(rid, None)
            if stream is not None:
                _deliver_many(stream[0], [(stream[1], err)])


def _deliver_many(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
