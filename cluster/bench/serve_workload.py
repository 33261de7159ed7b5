"""The workloads of `kvray bench serve`: fixed-length random prompts, or tenants that each
share a system prompt (what a prefix-affinity router is for)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from cluster.bench.common import BenchRequest, Workload, random_workload
from cluster.bench.tenants import zipf_tenant_workload


def build_workload(args: argparse.Namespace, token_ids: Sequence[int]) -> Workload:
    if args.workload == "json-schema":
        from cluster.bench.serve_structured import structured_workload

        return structured_workload(
            token_ids, num_prompts=args.num_prompts, input_len=args.input_len, seed=args.seed
        )
    if args.workload == "tenants-zipf":
        return zipf_tenant_workload(
            token_ids,
            num_prompts=args.num_prompts,
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            input_len=args.input_len,
            output_len=args.output_len,
            zipf_s=args.zipf_s,
            seed=args.seed,
        )
    if args.workload == "shared-prefix":
        return tenant_workload(
            token_ids,
            num_prompts=args.num_prompts,
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    w = random_workload(
        token_ids,
        num_prompts=args.num_prompts,
        input_len_range=(args.input_len, args.input_len),
        output_len_range=(args.output_len, args.output_len),
        seed=args.seed,
    )
    return Workload("random", w.requests, w.params)


def tenant_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    num_tenants: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> Workload:
    """Multi-tenant shared prefixes: each tenant has its own system prompt (prefix_len tokens);
    each request = a random tenant's prefix + its own random suffix, input_len tokens in all."""
    if num_tenants < 1 or not 0 < prefix_len < input_len or output_len < 1:
        raise ValueError(
            "need --num-tenants >= 1, 0 < --prefix-len < --input-len, --output-len >= 1"
        )
    rng = random.Random(seed)
    prefixes = [tuple(rng.choices(token_ids, k=prefix_len)) for _ in range(num_tenants)]
    requests = tuple(
        BenchRequest(
            prefixes[rng.randrange(num_tenants)]
            + tuple(rng.choices(token_ids, k=input_len - prefix_len)),
            output_len,
        )
        for _ in range(num_prompts)
    )
    params = {
        "num_tenants": num_tenants,
        "prefix_len": prefix_len,
        "input_len": input_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("shared-prefix", requests, params)
