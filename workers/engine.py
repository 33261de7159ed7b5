"""LLMEngine: add requests, then `step()` = schedule -> execute -> update, until done."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from workers.block_manager import BlockManager
from workers.config import EngineArgs, EngineConfig
from workers.executor import Executor, create_executor
from workers.output_processor import (
    completion_output,
    finish_abort,
    new_output_state,
    process_token,
)
from workers.outputs import RequestMetrics, RequestOutput
from workers.request import SeqStatus, Sequence
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler
from workers.stats import EngineStats
from workers.step import CachedSeq, NewSeq, StepInput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    stream: bool
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, progress: bool = False, executor: Executor | None = None
    ) -> None:
        from workers.tokenizer import Tokenizer

        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model.path)
        self.executor = executor or create_executor(config, progress=progress)
        self.block_manager = BlockManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Sequence] = {}
        self._removed: list[str] = []  # sequences the workers must forget next step
        self.eos_token_ids = tuple(config.model.eos_token_ids) or tuple(
            self.tokenizer.eos_token_ids
        )
        self.vocab_size = config.model.vocab_size
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Bounded: nobody may be reading them (offline use).
        self.step_token_counts: deque[int] = deque(maxlen=4096)
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%d tokens), max_model_len %d, device %s",
            config.served_model_name,
            self.block_manager.num_blocks,
            config.cache.block_size,
            self.block_manager.num_blocks * config.cache.block_size,
            config.scheduler.max_model_len,
            config.device_type,
        )

    @classmethod
    def from_args(cls, args: EngineArgs, progress: bool = False) -> LLMEngine:
        return cls(args.create_config(), progress=progress)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # -- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        ids = list(prompt)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = False,
        arrival_time: float | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt must not be empty (it encodes to no tokens)")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len ({limit})"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + prompt length ({len(ids)}) exceeds "
                f"max_model_len ({limit})"
            )
        params = replace(params, eos_token_ids=self.eos_token_ids)
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs: list[Sequence] = []
        for i in range(params.n):
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            seq = Sequence(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=p,
                arrival_time=now,
                prompt=text,
            )
            seq.out = new_output_state(seq, self.tokenizer)
            if i and self.config.cache.enable_prefix_caching:
                seq.gate = seqs[0]
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)  # raises before anything is registered if it can never fit
        req = Request(request_id, text, ids, params, seqs, stream, now)
        self.requests[request_id] = req
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            finish_abort(seq)
            self._retire(seq)
        return self._finish_request(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            if seq.on_workers:
                self._removed.append(seq.seq_id)
                seq.on_workers = False
        if not sched.scheduled:
            return []
        step = self._step_input(sched.scheduled)
        result = self.executor.execute(step)
        now = time.monotonic()
        self.num_steps += 1
        self.step_token_counts.append(sched.num_batched_tokens)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
        touched: dict[str, Request] = {}
        lps = result.logprobs
        for i, (sid, token) in enumerate(zip(result.seq_ids, result.token_ids, strict=True)):
            seq = self.seqs[sid]
            if seq.first_token_time is None:
                seq.first_token_time = now
                if seq.index == 0:
                    self.prompt_tokens += seq.prompt_len
            seq.token_ids.append(token)
            seq.token_times.append(now)
            self.generation_tokens += 1
            process_token(seq, token, lps[i] if lps is not None else None, self.max_model_len)
            if seq.finish_reason is not None:
                self._retire(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs: list[RequestOutput] = []
        for req in touched.values():
            if req.finished:
                outputs.append(self._finish_request(req))
            elif req.stream:
                outputs.append(self._output(req, delta=True))
        return outputs

    def _step_input(self, scheduled: list[tuple[Sequence, int]]) -> StepInput:
        step = StepInput(removed=self._removed)
        self._removed = []
        for seq, n in scheduled:
            if not seq.on_workers:
                step.new.append(
                    NewSeq(
                        seq.seq_id,
                        seq.prompt_token_ids,
                        list(seq.token_ids),
                        seq.params,
                        list(seq.block_ids),
                        seq.num_computed_tokens,
                        n,
                    )
                )
                seq.on_workers = True
            else:
                step.cached.append(
                    CachedSeq(
                        seq.seq_id,
                        seq.token_ids[seq.sent_tokens :],
                        seq.block_ids[seq.sent_blocks :],
                        seq.num_computed_tokens,
                        n,
                    )
                )
            seq.sent_tokens = len(seq.token_ids)
            seq.sent_blocks = len(seq.block_ids)
        return step

    def _retire(self, seq: Sequence) -> None:
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.remove(seq)
        if seq.on_workers:
            self._removed.append(seq.seq_id)
            seq.on_workers = False
        self.seqs.pop(seq.seq_id, None)

    def _finish_request(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        out = self._output(req, delta=True)
        now = time.monotonic()
        seqs = req.seqs
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        scheds = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        out.metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=min(scheds) if scheds else None,
            first_token_time=min(firsts) if firsts else None,
            finished_time=now,
            token_times=sorted(t for s in seqs for t in s.token_times),
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=sum(s.num_output_tokens for s in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
        )
        return out

    def _output(self, req: Request, delta: bool) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion_output(s, delta) for s in req.seqs],
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
        )

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
        )

    def pop_step_token_counts(self) -> list[int]:
        counts = list(self.step_token_counts)
        self.step_token_counts.clear()
        return counts

    def shutdown(self) -> None:
        self.executor.shutdown()
