"""The workloads of `kvray bench serve`: fixed-length random prompts, tenants that each
share a system prompt (what a prefix-affinity router is for), or prompts naming LoRA adapters
(serve/lora.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cluster.bench.common.workload import Workload, random_workload
from cluster.bench.serve.tenants import zipf_tenant_workload


def build_workload(args: argparse.Namespace, token_ids: Sequence[int]) -> Workload:
    if args.workload == "lora":
        from cluster.bench.serve.lora import lora_workload

        return lora_workload(
            token_ids,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            num_adapters=args.num_adapters,
            zipf_s=args.lora_zipf_s,
            seed=args.seed,
        )
    if args.workload == "json-schema":
        from cluster.bench.serve.structured import structured_workload

        return structured_workload(
            token_ids, num_prompts=args.num_prompts, input_len=args.input_len, seed=args.seed
        )
    if args.workload in ("tenants-zipf", "shared-prefix"):
        # shared-prefix: every tenant equally likely (Zipf with s = 0).
        zipf_s = args.zipf_s if args.workload == "tenants-zipf" else 0.0
        w = zipf_tenant_workload(
            token_ids,
            num_prompts=args.num_prompts,
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            input_len=args.input_len,
            output_len=args.output_len,
            zipf_s=zipf_s,
            seed=args.seed,
        )
        return Workload(args.workload, w.requests, w.params)
    w = random_workload(
        token_ids,
        num_prompts=args.num_prompts,
        input_len_range=(args.input_len, args.input_len),
        output_len_range=(args.output_len, args.output_len),
        seed=args.seed,
    )
    return Workload("random", w.requests, w.params)
