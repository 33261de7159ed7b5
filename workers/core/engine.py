"""LLMEngine: add requests, then `step()` = schedule -> execute -> update, until done.

Requests arrive checked (`workers.inputs.EngineInput`, built by `InputChecker`); the engine
trusts them and only refuses what depends on its own state: a request_id already in use, a
prompt that can never fit in the KV cache. Each step returns what the requests' output kinds
ask for (see `workers.outputs`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from workers.config import EngineArgs, EngineConfig, fit_to_kv_cache
from workers.core.block_manager import BlockManager
from workers.core.engine_stats import engine_stats
from workers.core.expert_report import latest_expert_tokens, report_experts_if_idle
from workers.core.output_processor import (
    finish_abort,
    finish_out_of_cache,
    finish_pooled,
    new_output_state,
    record_prompt_logprobs,
    request_delta_output,
    request_final_output,
    resume_output_state,
)
from workers.core.request import Request, Seq, SeqStatus
from workers.core.sampled_tokens import take_sampled
from workers.core.scheduler import Scheduler, SchedulerOutput
from workers.core.speculator import Speculator, can_speculate
from workers.core.stats import EngineStats
from workers.core.step_diff import build_step_input
from workers.executor.base import Executor, create_executor
from workers.executor.pending import Launched, Resolved
from workers.inputs import EngineInput, InputChecker
from workers.lora.slots import LoraSlotTable
from workers.outputs import QUEUE_TIMEOUT, RequestOutput, RequestOutputKind
from workers.sampling_params import SamplingParams
from workers.structured import GRAMMAR_ERROR, check_structured
from workers.structured.compiler import GrammarCompiler
from workers.structured.decoding import StructuredDecoding

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, progress: bool = False, executor: Executor | None = None
    ) -> None:
        from workers.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_pretrained(config.model.tokenizer or config.model.path)
        self.executor = executor or create_executor(config, progress=progress)
        # Only now is the KV cache sized: max_model_len must fit it (see fit_to_kv_cache).
        kv_cache_tokens = self.executor.num_blocks * config.cache.block_size
        try:
            config = fit_to_kv_cache(config, kv_cache_tokens)
        except ValueError:
            if executor is None:
                self.executor.shutdown()  # ours: no ranks or memory left behind
            raise
        self.config = config
        # What the workers run, fixed at their start (the CPU kernels' state, for stats()).
        self.worker_info: dict[str, str] = self.executor.info()
        self.block_manager = BlockManager.for_engine(config, self.executor.num_blocks)
        # LoRA: the adapters' device slots (None: the engine serves the base model only).
        self.lora_slots = LoraSlotTable.of(config, self.executor.lora_adapters)
        self.lora_load_seconds = 0.0
        self.moe_expert_tokens: tuple[tuple[int, ...], ...] = ()  # EngineStats' field
        self.expert_tokens_step = 0  # num_steps when an idle engine last asked for them
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.lora_slots)
        try:  # speculative decoding (workers/core/speculator.py); None: off
            self.speculator = Speculator.for_engine(config, LLMEngine)
        except Exception:
            if executor is None:
                self.executor.shutdown()  # ours: no ranks or memory left behind
            raise
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Seq] = {}
        self._removed: list[str] = []  # sequences the workers must forget next step
        # Async scheduling: the step launched last, whose tokens the next step() processes.
        self._in_flight: Launched | None = None
        # Queue deadlines (time.monotonic()) of requests no step has taken yet.
        self._queue_deadlines: dict[str, float] = {}
        self.eos_token_ids = tuple(config.model.eos_token_ids) or tuple(
            self.tokenizer.eos_token_ids
        )
        self.input_checker = InputChecker(
            config.model.vocab_size, config.scheduler.max_model_len, kv_cache_tokens
        )
        # Constrained decoding: grammars compile on a background thread, cached by spec.
        self.structured = StructuredDecoding(
            GrammarCompiler(
                self.tokenizer.hf,
                config.model.vocab_size,
                self.eos_token_ids,
                config.structured.grammar_cache_size,
            ),
            config.model.vocab_size,
            config.structured.grammar_timeout_s,
        )
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Bounded: nobody may be reading them (offline use).
        self.step_token_counts: deque[int] = deque(maxlen=4096)
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%d tokens, %s), max_model_len %d, "
            "device %s",
            config.served_model_name,
            self.block_manager.num_blocks,
            config.cache.block_size,
            self.block_manager.num_blocks * config.cache.block_size,
            config.kv_dtype_name,
            config.scheduler.max_model_len,
            config.device_type,
        )

    @classmethod
    def from_args(cls, args: EngineArgs, progress: bool = False) -> LLMEngine:
        return cls(args.create_config(), progress=progress)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    # -- requests -----------------------------------------------------------------------------
    def add_prompt(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Checks a raw prompt (text or token ids) with `input_checker`, then adds it."""
        inp = self.input_checker.check_prompt(prompt, params, self.tokenizer, priority=priority)
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs, self.tokenizer)
        return self.add_request(request_id, inp, arrival_time)

    def add_request(
        self,
        request_id: str,
        inp: EngineInput,
        arrival_time: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> Request:
        """Admits a checked request. Raises ValueError only for what depends on the engine's
        state: a request_id in use, a prompt the KV cache can never hold.

        A request that no step has taken `queue_timeout_s` after `arrival_time` finishes
        unrun, its samples aborted with stop_reason QUEUE_TIMEOUT (`is_queue_timeout`)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if inp.lora is not None:
            if self.lora_slots is None:
                raise ValueError("lora: this engine serves no adapters (start it with enable_lora)")
            self.lora_slots.check(inp.lora)  # LoraError (a ValueError) for a bad adapter
        params = inp.params.derived(eos_token_ids=self.eos_token_ids)  # checked already
        ids = list(inp.prompt_token_ids)
        now = arrival_time if arrival_time is not None else time.monotonic()
        # A resumed request (inp.resume) runs only its unfinished samples, each under its own
        # index (hence seed) and continuing from its earlier outputs: the scheduler recomputes
        # prompt + outputs as after a preemption, and the sampler's seeded noise depends only
        # on (seed, outputs so far), so the sample goes on exactly as it would have.
        resumed = {r.index: r for r in inp.resume}
        seqs: list[Seq] = []
        for i in sorted(resumed) if resumed else range(params.n):
            p = params if params.seed is None or i == 0 else params.derived(seed=params.seed + i)
            if i > 0 and p.prompt_logprobs is not None:
                # The samples share one prompt: the first scores it, the others reuse its
                # cached blocks (the gate below) instead of computing it again.
                p = p.derived(prompt_logprobs=None)
            seq = Seq(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=p,
                priority=inp.priority,
                arrival_time=now,
                tenant=inp.tenant,
                lora=inp.lora,
            )
            seq.out = new_output_state(seq, self.tokenizer)
            r = resumed.get(i)
            if r is not None:
                resume_output_state(
                    seq, r.output_token_ids, r.text_sent, r.logprobs, self.max_model_len
                )
            if seqs and self.config.cache.enable_prefix_caching:
                seq.gate = seqs[0]
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)  # raises before anything is registered if it can never fit
        if inp.kv_blocks:  # pulled from another replica: restored as the prompt is scheduled
            self.block_manager.import_blocks(inp.kv_blocks)
        req = Request(request_id, inp.prompt, ids, params, seqs, now)
        self.requests[request_id] = req
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
        self.structured.add(req)  # constrained: its sequences wait for their grammar
        if queue_timeout_s is not None:
            self._queue_deadlines[request_id] = now + queue_timeout_s
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.structured.forget(request_id)
        for seq in req.seqs:
            finish_abort(seq)
            self._retire(seq)
        return self._finish_request(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        touched: dict[str, Request] = {}
        if self._queue_deadlines:
            self._expire_queued(touched)
        if self.structured.has_pending:
            self._start_grammars(touched)
        if self._in_flight is not None and self._in_flight.host_bound:
            self._finish(self._in_flight, touched)  # the next step needs its tokens first
            self._in_flight = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled and self.structured.has_pending:
            self.structured.wait(0.01)  # nothing else to run: do not spin on the compile
        for seq in sched.preempted:
            if seq.on_workers:
                self._removed.append(seq.seq_id)
                seq.on_workers = False
        for seq in sched.out_of_cache:
            log.warning(
                "%s finished (length): %d tokens do not fit the KV cache (%d tokens)",
                seq.seq_id,
                seq.num_tokens,
                self.block_manager.num_blocks * self.block_manager.block_size,
            )
            finish_out_of_cache(seq)
            self._retire(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        # A step of decodes and drafts only: what the speculator's cost model learns from.
        decoding = self.speculator is not None and all(s.prefill_done for s, _ in sched.scheduled)
        launched = self._launch(sched) if sched.scheduled else None
        # Async scheduling: the step before this one resolves only now, while the device runs
        # the one just launched. Synchronous: the step just launched resolves at once.
        if self._in_flight is not None:
            self._finish(self._in_flight, touched)
        self._in_flight = None
        if launched is not None:
            if self.config.scheduler.async_scheduling:
                self._in_flight = launched
            else:
                self._finish(launched, touched)
            if decoding:
                self.speculator.record_step(sched.num_batched_tokens, time.perf_counter() - t0)
        outputs: list[RequestOutput] = []
        for req in touched.values():
            if req.finished:
                outputs.append(self._finish_request(req))
            elif req.params.output_kind is RequestOutputKind.DELTA:
                outputs.append(request_delta_output(req))
        report_experts_if_idle(self)  # the last steps' tokens per expert, once idle
        return outputs

    def _launch(self, sched: SchedulerOutput) -> Launched:
        """Sends the scheduled sequences' step to the workers. Each sequence whose step
        samples gets a token in flight (Seq.num_pending) until `_finish` learns its value."""
        lora_loads = [] if self.lora_slots is None else self.lora_slots.take_loads()
        grammar = self.structured.bitmask(sched.scheduled)
        step = build_step_input(sched, self._removed, grammar, lora_loads)
        self._removed = []
        if self.config.scheduler.async_scheduling:
            pending = self.executor.launch(step)
        else:
            pending = Resolved(self.executor.execute(step))
        if (t := step.kv_transfers) is not None and t.exports:  # workers/core/kv_share.py
            self.block_manager.exported(self.executor.take_kv_exports([h for h, _ in t.exports]))
        self.num_steps += 1
        self.step_token_counts.append(sched.num_batched_tokens)
        host_bound = False
        drafts: dict[str, list[int]] = {}
        for seq, n in sched.scheduled:
            if seq.draft:  # computed in the chunk, kept only as far as verified (_finish)
                drafts[seq.seq_id], seq.draft = seq.draft, []
                n -= len(drafts[seq.seq_id])
                host_bound = True  # the next step needs the tokens it keeps
            seq.num_computed_tokens += n
            # Blocks whose tokens are all known: the next schedule may already reuse them
            # (the device runs steps in order, so their K/V is written before it is read).
            self.block_manager.commit_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_planned_tokens and seq.params.pooling is None:
                seq.num_pending += 1
                # Its next mask (grammar, thinking budget) needs this token; penalty counts don't.
                host_bound = host_bound or seq.grammar is not None or seq.thinking_bound
                # A draft continues known tokens: async scheduling waits for them.
                host_bound = host_bound or (self.speculator is not None and can_speculate(seq))
        seqs = {seq.seq_id: seq for seq, _ in sched.scheduled}
        return Launched(pending, seqs, host_bound, drafts)

    def _finish(self, launched: Launched, touched: dict[str, Request]) -> None:
        """Processes a launched step's outputs (workers/core/sampled_tokens.py)."""
        result = launched.pending.result()
        self.lora_load_seconds += result.lora_load_s
        self.moe_expert_tokens = latest_expert_tokens(self.moe_expert_tokens, result.expert_tokens)
        now = time.monotonic()
        # Before the tokens: a first token may finish (and retire) a scored sequence.
        for sid, (first_pos, entries) in (result.prompt_logprobs or {}).items():
            if (seq := self._live(launched, sid)) is not None:
                record_prompt_logprobs(seq, first_pos, entries)
        take_sampled(self, launched, result, now, touched)
        if result.embeddings:
            self._pooled(launched, result.embeddings, now, touched)

    def _live(self, launched: Launched, sid: str) -> Seq | None:
        """The sequence a launched step computed for, unless it has ended since (aborted,
        finished, or its request id already reused by a new request)."""
        seq = launched.seqs.get(sid)
        return seq if seq is not None and self.seqs.get(sid) is seq else None

    def _pooled(self, launched: Launched, embeddings: dict[str, list[float]], now: float,
                touched: dict[str, Request]) -> None:  # fmt: skip
        """Embedding requests whose prompt finished this step (workers/device/scoring.py)."""
        for sid, embedding in embeddings.items():
            if (seq := self._live(launched, sid)) is None:
                continue
            # Its one result: the prompt counts as served, and TTFT is the time to it.
            seq.first_token_time = now
            self.prompt_tokens += seq.prompt_len
            finish_pooled(seq, embedding)
            self._retire(seq)
            touched[seq.request_id] = self.requests[seq.request_id]

    def _expire_queued(self, touched: dict[str, Request]) -> None:
        """Finishes the requests still unrun at their queue deadline; forgets the deadlines
        of requests a step has taken (or that ended)."""
        now = time.monotonic()
        for request_id, deadline in list(self._queue_deadlines.items()):
            req = self.requests.get(request_id)
            if req is None or any(s.first_scheduled_time is not None for s in req.seqs):
                del self._queue_deadlines[request_id]
            elif now >= deadline:
                del self._queue_deadlines[request_id]
                for seq in req.seqs:
                    finish_abort(seq, stop_reason=QUEUE_TIMEOUT)
                    self._retire(seq)
                touched[request_id] = req

    def _start_grammars(self, touched: dict[str, Request]) -> None:
        """Constrained requests whose grammar finished compiling become schedulable; those
        whose compile failed or timed out finish (abort, stop_reason GRAMMAR_ERROR)."""
        for req, _why in self.structured.poll():
            for seq in req.seqs:
                finish_abort(seq, stop_reason=GRAMMAR_ERROR)
                self._retire(seq)
            touched[req.request_id] = req

    def _retire(self, seq: Seq) -> None:
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.remove(seq)
        if seq.on_workers:
            self._removed.append(seq.seq_id)
            seq.on_workers = False
        self.seqs.pop(seq.seq_id, None)

    def _finish_request(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.structured.forget(req.request_id)
        self._queue_deadlines.pop(req.request_id, None)
        return request_final_output(req)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return engine_stats(self)

    def pop_step_token_counts(self) -> list[int]:
        counts = list(self.step_token_counts)
        self.step_token_counts.clear()
        return counts

    def shutdown(self) -> None:
        self.structured.compiler.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        self.executor.shutdown()
