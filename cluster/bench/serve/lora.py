"""`kvray bench serve --workload lora`: many LoRA adapters on one deployment, against the base
model alone.

    kvray bench serve --launch --workload lora --num-adapters 16 --max-loras 8

Writes `--num-adapters` random adapters of `--lora-rank` for the model (serve/random_lora.py; cached
under `--lora-dir`) and, with --launch, serves them (`--lora-modules NAME=PATH ...`,
`--max-lora-rank` = the rank, `--max-loras` if given). Each round, on each backend:

1. base: random prompts of `--input-len` tokens, every request naming the served model;
2. lora: the same prompts, each request naming an adapter drawn with Zipf popularity
   (P(adapter k) ~ 1 / k^s, `--lora-zipf-s`, seeded): a few hot adapters and a long tail.

Both runs' prompts get a first token of their own (serve/salt.py), so neither is served from
the prefix cache the other filled. Before the first round one short request per adapter makes
every adapter read once (the figures are then those of a warm deployment; slot loads and
evictions, when there are more adapters than `--max-loras`, stay in them). Reported per
backend: both runs' throughput and TTFT and the lora/base ratios (median over rounds), and per
adapter its requests and median TTFT. `--num-adapters 0` runs the base model alone.

Against --base-url the server must already serve the adapters under these names
(`kvray serve --lora-modules bench-lora-0=DIR/bench-lora-0 ...`, DIR printed by the bench).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.bench.common.backend_types import Backend, RequestRecord
from cluster.bench.common.workload import BenchRequest, Measure, Workload
from cluster.bench.serve.salt import salt_workload

WORKLOAD = "lora"
BASE, LORA = "base", "lora"
NAME_PREFIX = "bench-lora-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--workload lora: many LoRA adapters against the base model")
    a = g.add_argument
    a("--num-adapters", type=int, default=8, help="random adapters (default 8); 0: base only")
    a("--lora-rank", type=int, default=16, help="their rank (default 16)")
    a("--lora-zipf-s", type=float, default=1.0, help="P(adapter k) ~ 1/k^s (default 1.0)")
    a("--lora-dir", help="where they are written (default: ~/.cache/kvray/lora/MODEL-RANK)")
    a("--max-loras", type=int, help="--launch, inprocess: adapter slots per engine")


def adapter_names(n: int) -> list[str]:
    """The adapters' names, most popular first."""
    return [f"{NAME_PREFIX}{k}" for k in range(n)]


def lora_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    num_adapters: int,
    zipf_s: float,
    seed: int,
) -> Workload:
    """Random prompts, each naming adapter k of `num_adapters` with P ~ 1 / (k + 1)^zipf_s
    (none: the base model)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1 or num_adapters < 0 or zipf_s < 0:
        raise ValueError(
            "need --num-prompts, --input-len, --output-len >= 1, --num-adapters >= 0, "
            "--lora-zipf-s >= 0"
        )
    rng = random.Random(seed)
    prompts = [tuple(rng.choices(token_ids, k=input_len)) for _ in range(num_prompts)]
    names = adapter_names(num_adapters)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_adapters)]
    models = rng.choices(names, weights=weights, k=num_prompts) if names else [""] * num_prompts
    requests = tuple(
        BenchRequest(p, output_len, model=m) for p, m in zip(prompts, models, strict=True)
    )
    params = {
        "num_adapters": num_adapters,
        "zipf_s": zipf_s,
        "input_len": input_len,
        "output_len": output_len,
        "distinct_adapters_drawn": len(set(models) - {""}),
        "seed": seed,
    }
    return Workload(WORKLOAD, requests, params)


def base_twin(workload: Workload) -> Workload:
    """The same requests, every one naming the base model."""
    requests = tuple(replace(r, model="") for r in workload.requests)
    return Workload(f"{WORKLOAD}-base", requests, workload.params)


def default_lora_dir(model_dir: Path, rank: int) -> Path:
    # The checkpoint's path in the name: two models of one basename get their own adapters.
    tag = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=4).hexdigest()
    return Path.home() / ".cache" / "kvray" / "lora" / f"{model_dir.name}-{tag}-r{rank}"


def prepare_adapters(args: argparse.Namespace, model_dir: Path) -> dict[str, str]:
    """Writes (or reuses) the workload's adapters: name -> directory."""
    from cluster.bench.serve.random_lora import write_random_adapters

    names = adapter_names(args.num_adapters)
    if not names:
        return {}
    root = Path(args.lora_dir) if args.lora_dir else default_lora_dir(model_dir, args.lora_rank)
    paths = write_random_adapters(model_dir, root, names, rank=args.lora_rank)
    print(f"{len(names)} random rank-{args.lora_rank} LoRA adapters in {root}", flush=True)
    if args.base_url and not args.launch:
        print(
            "the server must serve them: kvray serve --lora-modules "
            + " ".join(f"{n}={p}" for n, p in paths.items())
            + f" --max-lora-rank {args.lora_rank}",
            flush=True,
        )
    return {name: str(path) for name, path in paths.items()}


def server_overrides(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, Any]:
    """The launched app's ServeConfig fields that serve `adapters` (cluster/config/lora.py)."""
    if not adapters:
        return {}
    out: dict[str, Any] = {
        "enable_lora": True,
        "lora_modules": tuple(f"{name}={path}" for name, path in adapters.items()),
        "max_lora_rank": args.lora_rank,
    }
    if args.max_loras:
        out["max_loras"] = args.max_loras
    return out


def engine_overrides(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, Any]:
    """The in-process engine's EngineArgs for the same adapters."""
    if not adapters:
        return {}
    out: dict[str, Any] = {"enable_lora": True, "max_lora_rank": args.lora_rank}
    if args.max_loras:
        out["max_loras"] = args.max_loras
    return out


class AdapterRecorder:
    """A backend that notes which adapter each request named, for the per-adapter report."""

    def __init__(self, backend: Backend) -> None:
        self.name = backend.name
        self._backend = backend
        self.records: list[tuple[str, RequestRecord]] = []

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = await self._backend.send(req)
        self.records.append((req.model, rec))
        return rec

    async def close(self) -> None:
        await self._backend.close()

    def per_adapter(self) -> dict[str, dict[str, Any]]:
        by: dict[str, list[RequestRecord]] = {}
        for model, rec in self.records:
            by.setdefault(model or BASE, []).append(rec)
        return {
            name: {
                "requests": len(recs),
                "completed": sum(r.ok for r in recs),
                "ttft_median_ms": 1000 * statistics.median([r.ttft for r in recs if r.ok] or [0]),
            }
            for name, recs in sorted(by.items(), key=lambda kv: -len(kv[1]))
        }


async def lora_rounds(
    args: argparse.Namespace,
    workloads: Sequence[Workload],
    backends: Sequence[tuple[str, Any]],
    token_ids: Sequence[int],
    measure: Measure,
    group: str = "",
) -> list[dict[str, Any]]:
    """Every backend once per round: base, then lora (module doc). Backend i's base prompts
    start with token_ids[2i], its lora prompts with token_ids[2i + 1]."""
    names = adapter_names(args.num_adapters)
    rng = random.Random(args.seed + 1_000_003)
    warm = [BenchRequest(tuple(rng.choices(token_ids, k=8)), 2, model=n) for n in names]
    for _, backend in backends:
        await asyncio.gather(*(backend.send(req) for req in warm))
    summaries = []
    for r, workload in enumerate(workloads):
        for i, (label, backend) in enumerate(backends):
            base = salt_workload(base_twin(workload), 2 * i, token_ids)
            runs = [(BASE, backend, base)]
            if names:
                lora = salt_workload(workload, 2 * i + 1, token_ids)
                runs.append((LORA, AdapterRecorder(backend), lora))
            for kind, sender, w in runs:
                s = await measure(f"{label} {kind}", sender, args, w, r)
                s.update(group=group, base_backend=label, lora=kind)
                if isinstance(sender, AdapterRecorder):
                    s["per_adapter"] = sender.per_adapter()
                summaries.append(s)
    return summaries


def compare_lora(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per backend: lora vs base output throughput and median TTFT (medians over rounds)."""
    pairs: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for s in summaries:
        if "lora" in s:
            pairs.setdefault(s["base_backend"], {}).setdefault(s.get("round", 0), {})[s["lora"]] = s
    out: dict[str, Any] = {}
    for backend, by_round in pairs.items():
        both = [(p[LORA], p[BASE]) for p in by_round.values() if LORA in p and BASE in p]
        both = [(lo, b) for lo, b in both if b["output_throughput"]]
        if not both:
            continue
        out[backend] = {
            "rounds": len(both),
            "lora_output_tok_s": statistics.median(lo["output_throughput"] for lo, _ in both),
            "base_output_tok_s": statistics.median(b["output_throughput"] for _, b in both),
            "lora_ttft_median_ms": statistics.median(lo["ttft_ms"]["median"] for lo, _ in both),
            "base_ttft_median_ms": statistics.median(b["ttft_ms"]["median"] for _, b in both),
            "output_throughput_ratio": statistics.median(
                lo["output_throughput"] / b["output_throughput"] for lo, b in both
            ),
        }
    return out


def format_lora(summaries: Sequence[dict[str, Any]], comparison: dict[str, Any]) -> str:
    rows = ["LoRA adapters vs the base model alone, same prompts (medians over rounds):"]
    for backend, c in comparison.items():
        rows.append(
            f"  {backend}: output tok/s {c['lora_output_tok_s']:.1f} vs "
            f"{c['base_output_tok_s']:.1f} = {c['output_throughput_ratio']:.2f}x; median TTFT "
            f"{c['lora_ttft_median_ms']:.1f} vs {c['base_ttft_median_ms']:.1f} ms"
        )
    for s in summaries:
        if s.get("per_adapter"):
            rows.append(f"  requests per adapter, {s['backend']} (round {s.get('round', 0) + 1}):")
            for name, a in s["per_adapter"].items():
                ttft = a["ttft_median_ms"]
                rows.append(f"    {name:<20}{a['requests']:>6} requests, median TTFT {ttft:.1f} ms")
    return "\n".join(rows)
