"""Workloads shared by the benchmarks (their results and report: result.py).

A workload is a list of (prompt token ids, output length) pairs drawn from a seeded RNG, so
every backend in one command (and every run with the same seed) sees identical requests.
Prompts are random ids from the vocabulary minus special tokens; every request is meant to
run with ignore_eos so it produces exactly its output length (vLLM's random dataset does the
same), which makes token counts, and so throughput, comparable across backends.

Kept free of torch/transformers imports: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    output_len: int
    # A JSON schema as JSON text: the request is constrained to it and ends when its grammar
    # does (output_len is then a cap); "" = free text, exactly output_len tokens (ignore_eos).
    json_schema: str = ""
    # The `model` the request names: a LoRA adapter's name; "" = the served (base) model.
    model: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)  # how it was drawn, for the report

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(r.prompt_len + r.output_len for r in self.requests)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_prompts": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            **self.params,
        }


# How `kvray bench serve` measures one run (label, backend, args, workload, round) into its
# summary: what the paired-round workloads (serve/lora.py, serve/structured.py) are handed.
Measure = Callable[[str, Any, argparse.Namespace, Workload, int], Awaitable[dict[str, Any]]]


def sampleable_token_ids(model_dir: str | Path) -> list[int]:
    """Ids a random prompt may use: the tokenizer's vocabulary minus its special tokens.

    Special tokens are left out because a random <|im_end|> or BOS in the middle of a prompt
    changes what some engines do with it (chat-template handling, BOS de-duplication).
    """
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    raw = json.loads(path.read_text())
    special = {t["id"] for t in raw.get("added_tokens", []) if t.get("special")}
    ids = [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special]
    if not ids:
        raise ValueError(f"{path} has no non-special tokens to draw prompts from")
    return ids


def random_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int,
) -> Workload:
    """Uniform random prompt and output lengths (inclusive ranges), uniform random tokens."""
    _check_range("--input-len-range", input_len_range)
    _check_range("--output-len-range", output_len_range)
    rng = random.Random(seed)
    requests = tuple(
        BenchRequest(
            prompt_ids=tuple(rng.choices(token_ids, k=rng.randint(*input_len_range))),
            output_len=rng.randint(*output_len_range),
        )
        for _ in range(num_prompts)
    )
    params = {
        "input_len_range": list(input_len_range),
        "output_len_range": list(output_len_range),
        "seed": seed,
    }
    return Workload("default", requests, params)


def shared_prefix_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
) -> Workload:
    """Every prompt = one common random prefix + its own random suffix (a system prompt, RAG)."""
    if min(prefix_len, suffix_len) < 0 or output_len < 1 or prefix_len + suffix_len < 1:
        raise ValueError("--prefix-len/--suffix-len must be >= 0 and --output-len >= 1")
    rng = random.Random(seed)
    prefix = tuple(rng.choices(token_ids, k=prefix_len))
    requests = tuple(
        BenchRequest(prefix + tuple(rng.choices(token_ids, k=suffix_len)), output_len)
        for _ in range(num_prompts)
    )
    params = {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("shared-prefix", requests, params)


# Warm-ups draw from their own seed, so their prompts are not the measured ones.
_WARMUP_SEED_OFFSET = 7919


def warmup_workload(token_ids: Sequence[int], *, seed: int, num: int = 4) -> Workload:
    """A few short requests for warm-up, drawn independently of the measured workload.

    Independent on purpose: warming up with the measured prompts (or their prefixes) would
    leave them in a prefix cache and flatter the engine that has one.
    """
    return random_workload(
        token_ids,
        num_prompts=num,
        input_len_range=(8, 32),
        output_len_range=(4, 8),
        seed=seed + _WARMUP_SEED_OFFSET,
    )


def shaped_warmup(
    token_ids: Sequence[int], workload: Workload, *, seed: int, max_output: int = 8
) -> Workload:
    """A warm-up of the measured workload's shape with other tokens: as many requests, the same
    prompt lengths (so the same prefill step sizes and decode batch sizes), short outputs.

    A backend's first steps of a new shape pay one-time costs (kernel loading and GEMM
    heuristics on CUDA, primitive creation on CPU); warming up on a few short requests left
    them in the timed run of whichever backend ran first. Fresh tokens keep the prefix cache
    from being flattered, as in `warmup_workload`.
    """
    warm_seed = seed + _WARMUP_SEED_OFFSET
    rng = random.Random(warm_seed)
    requests = tuple(
        BenchRequest(
            prompt_ids=tuple(rng.choices(token_ids, k=q.prompt_len)),
            output_len=min(q.output_len, max_output),
        )
        for q in workload.requests
    )
    return Workload("warm-up", requests, {"shaped_like": workload.name, "seed": warm_seed})


def _check_range(flag: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if low < 1 or high < low:
        raise ValueError(f"{flag} must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
