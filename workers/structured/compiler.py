"""`GrammarCompiler`: compiles `StructuredOutputs` specs off the engine's step loop.

Compiles run on one background thread (llguidance releases the GIL while it builds a parser);
the step loop only polls futures. Compiled grammars live in a bounded LRU keyed by the spec
(without `after`), so a schema used by many requests is compiled once and each sequence gets
a cheap copy of its start state. The llguidance tokenizer (about a second to build) is built
on the same thread by the first compile, so engines that never see a constrained request
never pay it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from workers.core.stats import RECENT_COMPILES
from workers.structured.backend import CompiledGrammar, build_tokenizer, grammar_text
from workers.structured.spec import StructuredOutputs


@dataclass(frozen=True)
class CompilerStats:
    """Cumulative counts since the engine started."""

    structured_requests: int = 0  # requests with a constraint
    cache_hits: int = 0  # requests whose grammar was in the cache (compiled or compiling)
    cache_misses: int = 0  # requests that started a compile
    compile_seconds: float = 0.0  # total seconds spent compiling (tokenizer build excluded)
    compiles: int = 0  # compiles finished (successful or not)
    recent_compile_seconds: tuple[float, ...] = ()  # the latest, oldest first


class GrammarCompiler:
    """Futures of compiled grammars, by spec. One per engine; `shutdown()` when done."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int,
    ) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputs, Future[CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None  # built on the pool thread by the first compile
        self._lock = threading.Lock()  # guards the counters the pool thread updates
        self._requests = self._hits = self._misses = self._compiles = 0
        self._compile_s = 0.0
        # Seconds of the latest compiles, for the metrics' histogram (see EngineStats).
        self._recent: deque[float] = deque(maxlen=RECENT_COMPILES)

    def get(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The compiled grammar of `spec`, compiled in the background when not cached."""
        self._requests += 1
        # `after` only says where the grammar starts (StructuredDecoding applies it): specs
        # differing in it alone share one compile.
        spec = spec.grammar_key
        fut = self._cache.get(spec)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._hits += 1
            self._cache.move_to_end(spec)
            return fut
        self._misses += 1
        fut = self._executor().submit(self._compile, spec)
        self._cache[spec] = fut
        self._cache.move_to_end(spec)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)  # holders of an evicted future keep their copy
        return fut

    def _executor(self) -> ThreadPoolExecutor:
        # One thread: compiles are rare once cached, and the step loop keeps the other core.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvray-grammar")
        return self._pool

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self._hf, self._vocab_size, self._eos)
        t0 = time.perf_counter()
        try:
            return CompiledGrammar(self._tokenizer, grammar_text(spec))
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                self._compiles += 1
                self._compile_s += seconds
                self._recent.append(seconds)

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(
                structured_requests=self._requests,
                cache_hits=self._hits,
                cache_misses=self._misses,
                compile_seconds=self._compile_s,
                compiles=self._compiles,
                recent_compile_seconds=tuple(self._recent),
            )

    def shutdown(self) -> None:
        if self._pool is not None:
            # A compile in progress cannot be interrupted; do not wait for it.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
