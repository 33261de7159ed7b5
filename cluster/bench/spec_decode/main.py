"""`kvray bench spec-decode`: output tokens/s with speculative decoding off, at a fixed draft
length and adaptive, side by side in one run, per batch size and workload.

One engine of the same checkpoint per mode (off; prompt lookup with a fixed draft length;
prompt lookup adaptive; with --draft-model, a draft model, adaptive), built once and warmed
up, the modes taking turns per measurement, the same prompts:

- `repeat`: greedy decoding. A random-weight checkpoint (`--model random:...`, std 0.02 like a
  fresh initialisation) falls into repeating runs, where prompt lookup finds its drafts: the
  copy-heavy case (a summary quoting its source, an edit of given code), not real text.
- `open`: sampling at temperature 1 (seeded): the same model's text barely repeats, so drafts
  are rarely proposed or accepted: what speculation costs where it does not pay.

Each batch size B runs the first B prompts once per mode, every sequence to --max-tokens
(ignore_eos). The table gives each mode's output tokens/s, its ratio to off, the draft
tokens' acceptance rate and the tokens per verifying step (1 + accepted / drafts).

    OMP_NUM_THREADS=1 kvray bench spec-decode --model random:qwen3-100m --batch-sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.common.result import write_result_json

WORKLOADS = ("repeat", "open")


@dataclass(frozen=True)
class Row:
    workload: str
    batch: int
    mode: str
    tokens_per_s: float
    acceptance: float | None  # accepted / draft tokens (None: no drafts)
    per_draft: float | None  # tokens per verifying step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_model_argument(parser)
    a("--batch-sizes", default="1,4,16,64", help="comma-separated (default %(default)s)")
    a("--num-speculative-tokens", type=int, default=4, help="k (default %(default)s)")
    a("--max-tokens", type=int, default=128, help="output tokens per sequence (default 128)")
    a("--prompt-len", type=int, default=32, help="random prompt tokens (default 32)")
    a("--workloads", default=",".join(WORKLOADS), help="repeat,open (default both)")
    a(
        "--draft-model",
        default=None,
        help="also a draft-model mode (adaptive): a checkpoint directory or random:NAME with the "
        "model's vocabulary (e.g. random:qwen3-tiny for random:qwen3-100m)",
    )
    a("--json", default=None, help="also write the rows to this file")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from workers import LLM

    model = str(bench_model_dir(args.model))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(max(sizes))
    ]
    k = args.num_speculative_tokens
    configs: dict[str, Any] = {
        "off": None,
        "fixed": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False},
        "adaptive": {"method": "ngram", "num_speculative_tokens": k},
    }
    if args.draft_model:
        draft = str(bench_model_dir(args.draft_model))
        configs["draft"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    rows: list[Row] = []
    # Every mode's engine at once, the modes interleaved per measurement: a machine that drifts
    # (another process, frequency) then moves every mode alike.
    llms = {
        mode: LLM(
            model,
            kv_cache_memory_bytes=1 << 30,
            max_num_seqs=max(sizes),
            speculative_config=configs[mode],
        )
        for mode in configs
    }
    bar = tqdm(total=len(configs) * len(workloads) * len(sizes), desc="bench spec-decode")
    try:
        for llm in llms.values():
            llm.generate(prompts[:4], _params("repeat", 16), use_tqdm=False)  # warm-up
        for workload in workloads:
            for b in sizes:
                for mode, llm in llms.items():
                    rows.append(_measure(llm, prompts[:b], workload, b, mode, args.max_tokens))
                    bar.update()
    finally:
        for llm in llms.values():
            llm.engine.shutdown()
    bar.close()
    print(table(rows))
    if args.json:
        write_result_json(args.json, {"rows": [r.__dict__ for r in rows], "model": args.model})
    return 0


def _params(workload: str, max_tokens: int):  # noqa: ANN202 - workers imported lazily
    from workers import SamplingParams

    if workload == "repeat":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=True)


def _measure(llm: Any, prompts: list, workload: str, b: int, mode: str, max_tokens: int) -> Row:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(workload, max_tokens), use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    proposed = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    return Row(
        workload,
        b,
        mode,
        tokens / elapsed,
        accepted / proposed if proposed else None,
        1 + accepted / drafts if drafts else None,
    )


def table(rows: list[Row]) -> str:
    """One line per (workload, batch): off's tok/s, then each mode's tok/s, its ratio to off,
    its draft tokens' acceptance and tokens per verifying step."""
    modes = list(dict.fromkeys(r.mode for r in rows if r.mode != "off"))
    head = "| workload | batch | off tok/s |" + "".join(
        f" {m} tok/s | {m} × | {m} acceptance | {m} tokens/draft |" for m in modes
    )
    lines = [head, "|" + " --- |" * (3 + 4 * len(modes))]
    by = {(r.workload, r.batch, r.mode): r for r in rows}
    for workload, batch in dict.fromkeys((r.workload, r.batch) for r in rows):
        off = by[(workload, batch, "off")]
        cells = [workload, str(batch), f"{off.tokens_per_s:,.0f}"]
        for m in modes:
            r = by[(workload, batch, m)]
            cells += [
                f"{r.tokens_per_s:,.0f}",
                f"{r.tokens_per_s / off.tokens_per_s:.2f}",
                "—" if r.acceptance is None else f"{r.acceptance:.0%}",
                "—" if r.per_draft is None else f"{r.per_draft:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
