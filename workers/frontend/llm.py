"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from workers.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, EngineArgs
from workers.core.engine import LLMEngine
from workers.inputs import CheckedRequest
from workers.lora.request import LoRARequest
from workers.outputs import RequestOutput, RequestOutputKind
from workers.pooling import Pooling
from workers.sampling_params import SamplingParams
from workers.structured import check_structured


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        device: str | None = None,
        **kwargs,
    ) -> None:
        args = EngineArgs(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            device=device,
            **kwargs,
        )
        self.engine = LLMEngine.from_args(args, progress=True)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. `priority`: one per prompt, lower
        is more urgent (the engine's queue order; workers/core/scheduler.py). `lora_request`:
        the adapter every prompt runs under, or one per prompt (None: the base model); the
        engine needs `enable_lora=True` (workers/lora/).

        Every request is validated before any runs; a bad one raises ValueError naming the
        field and nothing is generated.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        # Check every request before admitting any. Only final outputs are returned, so the
        # engine is asked for nothing else (no per-step deltas).
        checker, tokenizer = self.engine.input_checker, self.engine.tokenizer
        final: dict[int, SamplingParams] = {}  # one copy per distinct params object
        for p in plist:
            if id(p) not in final:
                final[id(p)] = _final_only(p)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        # What prompts share (their params, priority and adapter) is checked once, then each
        # prompt: a list of prompts under one SamplingParams validates it once.
        requests: dict[tuple[int, int, int], CheckedRequest] = {}
        inputs = []
        for prompt, p, rank, lo in zip(prompts, plist, priorities, loras, strict=True):
            key = (id(p), id(rank), id(lo))  # all alive in the lists above: the ids are stable
            if key not in requests:
                requests[key] = checker.request(final[id(p)], rank, lora=lo)
            inputs.append(requests[key].prompt(prompt, tokenizer))
        for p in final.values():
            if p.structured_outputs is not None:
                check_structured(p.structured_outputs, tokenizer)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, inp in zip(ids, inputs, strict=True):
                self.engine.add_request(rid, inp)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        pooling: Pooling | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order, its `embedding` the pooled
        final-norm hidden states of the prompt (workers/pooling.py; default: the last
        token's, L2-normalised). Prompts may fill the whole context (max_model_len)."""
        params = SamplingParams(max_tokens=1, pooling=pooling or Pooling())
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", leave=False)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [done[r] for r in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stats(self):  # noqa: ANN201
        return self.engine.stats()


def _final_only(params: SamplingParams) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
