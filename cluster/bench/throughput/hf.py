"""The transformers peers of `kvray bench throughput`.

- hf:    `generate` on static left-padded batches, filled in request order up to
         --hf-max-batch-size, each run to its longest output (vLLM's `run_hf` rule).
- hf-cb: transformers' own continuous batching (`init_continuous_batching`), one request per
         prompt with its own max_new_tokens.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.bench.common.result import BenchResult
from cluster.bench.common.workload import Workload
from cluster.bench.throughput.run import Run, length_notes, progress_bar


def _hf_dtype(r: Run) -> Any:
    import torch

    if r.args.dtype not in (None, "auto"):
        return getattr(torch, r.args.dtype)
    # float32 on CPU (the parity setting, and what CPUs run fastest without AMX); on GPUs the
    # checkpoint's own dtype.
    return torch.float32 if r.device == "cpu" else "auto"


def _load_hf(r: Run, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(r.model_dir), dtype=_hf_dtype(r), **kwargs)
    return model.to(r.device).eval()


def _never_eos(model: Any) -> int:
    """An EOS id outside the vocabulary: generation never stops early and no logit is masked."""
    return int(model.config.get_text_config().vocab_size)


def _pad_id(model: Any) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def hf_batches(workload: Workload, max_batch_size: int, max_len: int) -> list[list[Any]]:
    """Fill batches in request order up to max_batch_size, cutting early where the padded batch
    (longest prompt + longest output) would exceed the model's context."""
    batches: list[list[Any]] = []
    batch: list[Any] = []
    for req in workload.requests:
        if batch:
            longest_prompt = max(req.prompt_len, *(b.prompt_len for b in batch))
            longest_output = max(req.output_len, *(b.output_len for b in batch))
            if len(batch) >= max_batch_size or longest_prompt + longest_output > max_len:
                batches.append(batch)
                batch = []
        batch.append(req)
    if batch:
        batches.append(batch)
    return batches


def _hf_generate_batch(model: Any, batch: list[Any], device: str) -> None:
    import torch
    from transformers import GenerationConfig

    pad = _pad_id(model)
    width = max(req.prompt_len for req in batch)
    ids = [[pad] * (width - req.prompt_len) + list(req.prompt_ids) for req in batch]
    mask = [[0] * (width - req.prompt_len) + [1] * req.prompt_len for req in batch]
    config = GenerationConfig(
        max_new_tokens=max(req.output_len for req in batch),
        do_sample=False,
        eos_token_id=_never_eos(model),
        pad_token_id=pad,
    )
    with torch.no_grad():
        model.generate(
            torch.tensor(ids, device=device),
            attention_mask=torch.tensor(mask, device=device),
            generation_config=config,
        )


def run_hf(r: Run) -> BenchResult:
    model = _load_hf(r)
    max_len = int(getattr(model.config.get_text_config(), "max_position_embeddings", 1 << 30))
    if r.workload.max_seq_len > max_len:
        raise ValueError(f"workload needs {r.workload.max_seq_len} positions, model has {max_len}")
    size = r.args.hf_max_batch_size
    for batch in hf_batches(r.warmup, size, max_len):
        _hf_generate_batch(model, batch, r.device)
    batches = hf_batches(r.workload, size, max_len)
    _sync(r.device)
    start = time.perf_counter()
    with progress_bar(len(r.workload.requests), "hf") as bar:
        for batch in batches:
            _hf_generate_batch(model, batch, r.device)
            bar.update(len(batch))
    _sync(r.device)
    elapsed = time.perf_counter() - start
    del model
    return BenchResult(
        backend="hf",
        elapsed_s=elapsed,
        num_requests=len(r.workload.requests),
        prompt_tokens=r.workload.prompt_tokens,
        # Requested lengths, like vLLM: padding rows run to the batch's longest output.
        output_tokens=r.workload.output_tokens,
        notes=(f"{len(batches)} static batches of up to {size}",),
        extra={"hf_max_batch_size": size, "num_batches": len(batches)},
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_cb(r: Run) -> BenchResult:
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # sdpa works on CPU and GPU alike; on a GPU with flash-attn installed transformers would
    # switch to it by itself, which we allow there (it is what a user of hf-cb would get).
    model = _load_hf(r, attn_implementation="sdpa")
    both = r.workload.requests + r.warmup.requests
    page = 64
    cb_config = _cb_config(
        ContinuousBatchingConfig,
        page_size=page,
        # Room for every request at once: hf-cb should not be the one short of KV memory.
        num_blocks=sum(-(-(q.prompt_len + q.output_len) // page) for q in both) + 1,
        max_batch_tokens=r.args.max_num_batched_tokens or 2048,
        max_requests_per_batch=r.args.max_num_seqs,
        auto_switch_to_flash=r.device != "cpu",
        use_cuda_graph=False if r.device == "cpu" else None,
    )
    hints = WorkloadHints(
        max_prompt_length=max(q.prompt_len for q in both),
        max_generated_length=max(q.output_len for q in both),
        num_requests=len(r.workload.requests),
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model))
    # Without psutil, transformers logs an ERROR on CPU about memory sizing that does not apply:
    # we size the cache ourselves (num_blocks). Drop just that message while hf-cb runs.
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    nag = _DropPsutilNag()
    cb_logger.addFilter(nag)
    try:
        with model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            workload_hints=hints,
            block=True,
            timeout=30,
            warmup=True,
        ) as manager:
            _hf_cb_generate(manager, r.warmup, progress=False)
            _sync(r.device)
            start = time.perf_counter()
            generated = _hf_cb_generate(manager, r.workload, progress=True)
            _sync(r.device)
            elapsed = time.perf_counter() - start
    finally:
        cb_logger.removeFilter(nag)
    del model
    return BenchResult(
        backend="hf-cb",
        elapsed_s=elapsed,
        num_requests=len(r.workload.requests),
        prompt_tokens=r.workload.prompt_tokens,
        output_tokens=sum(generated),
        notes=tuple(length_notes(r.workload, generated)),
        extra={"page_size": page},
    )


class _DropPsutilNag:
    """logging filter: drops transformers' 'install psutil' messages, keeps everything else."""

    def filter(self, record: Any) -> bool:
        return "psutil" not in record.getMessage()


def _hf_cb_generate(manager: Any, workload: Workload, *, progress: bool) -> list[int]:
    """Submit every request with its own max_new_tokens; return generated lengths in order."""
    ids = [
        manager.add_request(list(req.prompt_ids), max_new_tokens=req.output_len, eos_token_id=-1)
        for req in workload.requests
    ]
    if any(i is None for i in ids):
        raise RuntimeError("continuous batching manager refused requests")
    done: dict[str, int] = {}
    with progress_bar(len(ids), "hf-cb", enabled=progress) as bar:
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            if result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
                bar.update(1)
    return [done[i] for i in ids]


def _cb_config(cls: Any, **kwargs: Any) -> Any:
    """transformers' ContinuousBatchingConfig across its versions: `page_size` was `block_size`
    up to 5.17, and options it does not know yet (auto_switch_to_flash) are left to its default."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    if "page_size" not in names and "block_size" in names:
        kwargs["block_size"] = kwargs.pop("page_size")
    return cls(**{k: v for k, v in kwargs.items() if k in names})
