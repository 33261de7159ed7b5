"""`kvray bench serve --overload N`: N requests at once against a launched (or given) app with
its default caps, far past them; the run and its verdict are in overload.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from cluster.bench.common.launch import server_context, single_app
from cluster.bench.common.result import write_result_json
from cluster.bench.common.workload import warmup_workload
from cluster.bench.serve import overload
from cluster.bench.serve.workload import build_workload


def run_command(args: argparse.Namespace, model_dir: Path, token_ids: Sequence[int]) -> int:
    workload = build_workload(
        argparse.Namespace(**{**vars(args), "num_prompts": args.overload}), token_ids
    )
    warmup = warmup_workload(token_ids, seed=args.seed, num=args.warmup_requests)
    print(
        f"kvray bench serve --overload: {args.overload} requests at once, {args.input_len} "
        f"prompt + {args.output_len} output tokens each"
    )
    base = server_context(args, model_dir)
    with contextlib.ExitStack() as stack:
        # The app's default caps (max_queued None): the point is to go far past them.
        ctx, app_name = single_app(args, base, stack, max_queued=None)
        # Its own event loop, closed before Serve and Ray shut down: the stats handle's router
        # runs on it and must not outlive them.
        summary = asyncio.run(
            overload.run_overload(
                args, ctx.base_url or "", ctx.model, workload.requests, warmup.requests, app_name
            )
        )
    overload.print_overload(summary)
    if args.result_json:
        write_result_json(args.result_json, {"workload": workload.describe(), "overload": summary})
        print(f"\nwrote {args.result_json}")
    return 0 if overload.overload_ok(summary) else 1
