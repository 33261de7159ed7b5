"""`kvray bench kv-tier`: what the cluster KV tier (`--kv-share-gib`) buys, per prefix length.

Six replicas (cluster/bench/kv_tier/replica.py: an AsyncEngine each in a Ray actor, every
engine configured alike with the host tier, KV events and block export) serve the same
prompts, a fresh random prefix of each length per repeat plus a 16-token suffix, so no arm
finds another repeat's blocks. Per prompt:

- origin computes the prefix (with another suffix), then serves prefix + suffix: `local`;
  then serves it again and is stopped after --failover-at streamed tokens (the request is
  aborted): the replica that failed mid-stream.
- `pull`: a replica that never saw the prefix, tier attached, its cost model's prefill prior
  so slow that it always pulls.
- `recompute`: a replica without the tier computes everything; its tokens are the reference.
- `auto`: a replica with the tier and the learned cost model (priors, then its own measured
  pulls and prefills): what it chose, and its estimates, beside the measured arms.
- `failover_pull` / `failover_recompute`: the stopped request resumed (EngineInput.resume,
  the tokens already streamed) on a replica with the tier (forced to pull: the published
  prefix and the streamed tokens' blocks) and on one without; their TTFT is the time to the
  next token.

TTFT is timed inside each replica, from the request's arrival (before the pull decision and
the pull) to its first streamed token. Each round waits until the origin's blocks are in
the directory, so the pull arms time a pull, not the publishing. Before the timed rounds
each engine serves two fresh prompts its cost model does not learn from (an engine's first
requests are slow), then four it does (two at the smallest length, two at the middle one),
then one untimed round at the smallest length and one at the longest warm every arm (the
longest makes the auto replica pull, so its pull path is warm too). Greedy tokens of
every arm must equal the recompute arm's: a mismatch is printed and the command exits 1. Per
round, the faster of `pull` and `recompute` (measured) is the right choice for `auto`: the
report says in how many rounds auto made it (report.py).

Then a multi-turn chat (cluster/bench/kv_tier/chat.py, --chat-turns 0: none) runs on 2
replicas without the tier (recomp, fo_recomp: what kvray does today) and on 2 with it and
the learned cost model (auto, and peer with its cost model turned into the learned one:
the prefill prior for the forced one, the pull rates it measured kept), turns alternating
between the two replicas: the prefix-hit rate and TTFT of both, the transcripts compared.

It starts a local Ray of its own, or uses the one this process already joined (tests).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.common.result import write_result_json
from cluster.bench.kv_tier import chat as chat_part
from cluster.bench.kv_tier.report import (
    ARM_KEYS,
    crossover,
    picked_faster_overall,
    summarize,
    tables,
)

GIB = 1 << 30
SUFFIX_LEN = 16
# Tokens each request may generate after the failover point (the resumed requests' share).
AFTER_FAILOVER = 8
# The lengths asked for by default, on a model that holds them.
DEFAULT_LENGTHS = (1024, 2048, 4096)
# Fresh prompts each engine computes before the warm-up round.
WARM_PROMPTS = 4
# Untimed, unlearned requests each engine serves first.
COLD_PROMPTS = 2
ROLES = ("origin", "peer", "recomp", "auto", "fo_pull", "fo_recomp")
FORCED = ("peer", "fo_pull")
NO_TIER = ("recomp", "fo_recomp")
# The chat's pairs of replicas (module doc); peer's cost model is unforced first.
CHAT_TODAY = ("recomp", "fo_recomp")
CHAT_TIER = ("auto", "peer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_model_argument(parser)
    a(
        "--prefix-lengths",
        default=None,
        help="comma-separated prefix lengths in tokens (default 1024,2048,4096 where the model "
        "holds them, else 1/8, 1/2 and 3/4 of its max_model_len)",
    )
    a("--repeats", type=int, default=5, help="prompts per prefix length (default 5)")
    a("--failover-at", type=int, default=16, help="tokens streamed before the stop (default 16)")
    a("--kv-share-gib", type=float, default=2.0, help="the tier's budget in the object store")
    a("--threads", type=int, default=None, help="torch threads per replica (default: all cores)")
    a("--seed", type=int, default=0)
    a("--result-json", default=None, metavar="FILE", help="write the results as JSON")
    chat_part.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    model_dir = bench_model_dir(args.model)
    max_tokens = args.failover_at + AFTER_FAILOVER
    limit, block, per_token = _model_shape(model_dir)
    lengths = _lengths(args.prefix_lengths, limit, max_tokens, block)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    chat = chat_part.chat_config(args, limit)
    longest = max(_parse(args.prefix_lengths)) if args.prefix_lengths else limit
    tokens = min(longest, limit) + SUFFIX_LEN + max_tokens + block
    if chat is not None:
        tokens = max(tokens, chat.longest + block)
    engine_kwargs = _engine_kwargs(model_dir, tokens, block, per_token)
    threads = args.threads or os.cpu_count() or 1
    print(
        f"kvray bench kv-tier: {model_dir}, prefix lengths {', '.join(map(str, lengths))}, "
        f"{args.repeats} repeats, {SUFFIX_LEN}-token suffix, failover after {args.failover_at} "
        f"tokens, {threads} torch threads per replica"
    )
    import ray

    own_ray = not ray.is_initialized()
    if own_ray:
        from cluster.cli.local_ray import init_local_ray

        init_local_ray(
            address="local",  # a new instance, never one another `ray start` left running
            include_dashboard=False,
            logging_level="WARNING",
            log_to_driver=False,
            # The tier may fill half of it (cluster/replica/kv_directory.py, tier_capacity).
            object_store_memory=int((2 * args.kv_share_gib + 1) * GIB),
        )
    app = f"kv-tier-bench-{os.getpid()}-{int(time.time())}"
    try:
        return _bench(args, app, engine_kwargs, lengths, max_tokens, threads, model_dir, chat)
    finally:
        from cluster.replica.kv_directory import delete_directory

        delete_directory(app)
        if own_ray:
            ray.shutdown()


def _bench(
    args: argparse.Namespace,
    app: str,
    engine_kwargs: dict[str, Any],
    lengths: list[int],
    max_tokens: int,
    threads: int,
    model_dir: Path,
    chat: chat_part.ChatConfig | None,
) -> int:
    import ray
    from tqdm import tqdm

    from cluster.bench.common.workload import sampleable_token_ids
    from cluster.bench.kv_tier.replica import TierReplica

    actor = ray.remote(num_cpus=0)(TierReplica)
    reps = {role: actor.remote(engine_kwargs, threads) for role in ROLES}
    try:
        info = ray.get(reps["origin"].describe.remote())
        ray.get([r.describe.remote() for r in reps.values()])  # every engine up
        capacity = int(args.kv_share_gib * GIB)
        ray.get(
            [
                reps[role].join.remote(app, capacity, role in FORCED)
                for role in ROLES
                if role not in NO_TIER
            ]
        )
        ids = sampleable_token_ids(model_dir)
        rng = random.Random(args.seed)
        # Warm-up (module doc): fresh prompts on every engine, half at the smallest length
        # and half at the middle one (the auto replica's cost model fits its prefill's fixed
        # cost and marginal rate to them), then untimed rounds through every arm.
        warm = [lengths[0], lengths[len(lengths) // 2]] * (WARM_PROMPTS // 2)
        for role in ROLES:
            # An engine's first requests are slow (its first steps allocate); a serving
            # replica's cost model sees thousands after them, so these are not learned.
            for _ in range(COLD_PROMPTS):
                prefix, _, suffix = _prompt(rng, ids, lengths[0])
                ray.get(reps[role].generate.remote(prefix + suffix, 1, learn=False))
            for n in warm:
                prefix, _, suffix = _prompt(rng, ids, n)
                ray.get(reps[role].generate.remote(prefix + suffix, 1))
        for n in (lengths[0], lengths[-1]):  # the longest: auto's pull path warms too
            _round(reps, _prompt(rng, ids, n), max_tokens, args.failover_at)
        samples: dict[int, dict[str, list[dict[str, Any]]]] = {
            n: {arm: [] for arm in ARM_KEYS} for n in lengths
        }
        mismatches: list[str] = []
        bar = tqdm(total=len(lengths) * args.repeats, desc="kv-tier rounds", unit="round")
        for n in lengths:
            for r in range(args.repeats):
                bar.set_postfix(prefix=n)
                got = _round(reps, _prompt(rng, ids, n), max_tokens, args.failover_at)
                mismatches += [f"prefix {n}, repeat {r}: {m}" for m in got.pop("mismatches")]
                for arm, sample in got.items():
                    samples[n][arm].append(sample)
                bar.update()
        bar.close()
        stats = {role: ray.get(reps[role].stats.remote()) for role in ROLES if role not in NO_TIER}
        chat_out = None
        if chat is not None:
            print(f"chat: {chat.conversations} conversations x {chat.turns} turns, twice")
            ray.get(reps["peer"].unforce.remote())
            chat_out = chat_part.run_chat(
                chat, args.seed, ids, [reps[r] for r in CHAT_TODAY], [reps[r] for r in CHAT_TIER]
            )
            mismatches += chat_out["mismatches"]
            chat_out["tier_stats_after"] = {r: ray.get(reps[r].stats.remote()) for r in CHAT_TIER}
    finally:
        for r in reps.values():
            ray.kill(r)
    return _report(args, info, lengths, max_tokens, samples, mismatches, stats, model_dir, chat_out)


def _round(
    reps: dict[str, Any], prompt: tuple[list[int], list[int], list[int]], t: int, fo: int
) -> dict[str, Any]:
    """One prompt through every arm (module doc); each arm's sample, and what mismatched."""
    import ray

    prefix, warm_suffix, suffix = prompt
    full = prefix + suffix

    def gen(role: str, **kw: Any) -> dict[str, Any]:
        return ray.get(reps[role].generate.remote(full, t, **kw))

    ray.get(reps["origin"].generate.remote(prefix + warm_suffix, 1))  # computes the prefix
    out: dict[str, Any] = {"local": gen("origin")}
    stopped = gen("origin", stop_after=fo)["tokens"]
    ray.get(reps["origin"].wait_published.remote(full + stopped))
    out["pull"] = gen("peer")
    out["recompute"] = ref = gen("recomp")
    out["auto"] = gen("auto")
    out["failover_pull"] = gen("fo_pull", resumed=stopped)
    out["failover_recompute"] = gen("fo_recomp", resumed=stopped)
    want = ref["tokens"]
    bad = [
        f"{arm}: {out[arm]['tokens']} != recompute's {want}"
        for arm in ("local", "pull", "auto")
        if out[arm]["tokens"] != want
    ]
    if stopped != want[:fo]:
        bad.append(f"the stopped stream {stopped} != recompute's first {fo} {want[:fo]}")
    bad += [
        f"{arm}: {out[arm]['tokens']} != recompute's {want[fo:]} after the failover"
        for arm in ("failover_pull", "failover_recompute")
        if out[arm]["tokens"] != want[fo:]
    ]
    for sample in out.values():
        del sample["tokens"]  # checked; the JSON keeps the timings
    out["mismatches"] = bad
    return out


def _prompt(rng: random.Random, ids: list[int], n: int) -> tuple[list[int], list[int], list[int]]:
    """A fresh prefix of n tokens, the origin's own suffix, and the measured suffix."""
    return tuple([rng.choice(ids) for _ in range(k)] for k in (n, SUFFIX_LEN, SUFFIX_LEN))  # type: ignore[return-value]


def _report(
    args: argparse.Namespace,
    info: dict[str, Any],
    lengths: list[int],
    max_tokens: int,
    samples: dict[int, dict[str, list[dict[str, Any]]]],
    mismatches: list[str],
    stats: dict[str, Any],
    model_dir: Path,
    chat: dict[str, Any] | None,
) -> int:
    summary = summarize(samples)
    print()
    print(
        f"{model_dir.name} on {info['device']} ({info['dtype']}), {args.repeats} repeats per "
        f"length, TTFT inside the replica (attach included)"
    )
    print(tables(summary))
    if chat is not None:
        print("\n" + chat_part.table(chat))
    pull_at, _ = crossover(lengths, [summary[str(n)]["pull_over_recompute"] for n in lengths])
    pulled = min(summary[str(n)]["pull_blocks"] for n in lengths)
    if pulled == 0:
        print("\nWARNING: the pull arm pulled no blocks for some length: its times are recomputes")
    if mismatches:
        print("\n" + "!" * 72)
        print(
            f"OUTPUT MISMATCH: {len(mismatches)} arm(s) or chat turn(s) differ from the recompute "
            "arm's tokens or from the chat's other run"
        )
        for m in mismatches:
            print(f"  {m}")
        print("!" * 72)
    else:
        print(
            "\ngreedy outputs: every arm equals the recompute arm's tokens"
            + (", the chat's transcripts are the same in both runs" if chat else "")
        )
    if args.result_json:
        payload = {
            "model": str(model_dir),
            **info,
            "prefix_lengths": lengths,
            "repeats": args.repeats,
            "suffix_len": SUFFIX_LEN,
            "failover_at": args.failover_at,
            "max_tokens": max_tokens,
            "summary": summary,
            "pull_wins_from_tokens": pull_at,
            "auto_picked_faster": picked_faster_overall(summary),
            "chat": chat,
            "outputs_match": not mismatches,
            "mismatches": mismatches,
            "samples": {str(n): arms for n, arms in samples.items()},
            "tier_stats": stats,
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
        }
        write_result_json(args.result_json, payload)
        print(f"wrote {args.result_json}")
    return 1 if mismatches else 0


def _model_shape(model_dir: Path) -> tuple[int, int, float]:
    """The model's max_model_len, KV block size and KV bytes per token."""
    from workers import EngineArgs
    from workers.kv_layout import kv_block_bytes

    config = EngineArgs(model=str(model_dir)).create_config()
    block = config.cache.block_size
    return config.scheduler.max_model_len, block, kv_block_bytes(config, 1) / block


def _engine_kwargs(model_dir: Path, tokens: int, block: int, per_token: float) -> dict[str, Any]:
    """Every replica's EngineArgs: a KV cache and a host tier sized for requests of up to
    `tokens` tokens."""
    # Room for a few prompts of the longest length on the device, and one pulled in the host
    # tier beside what the device evicts into it.
    cache_bytes = int(4 * tokens * per_token) + 64 * block * int(per_token)
    return {
        "model": str(model_dir),
        "kv_events": True,
        "kv_share": True,
        "kv_offload_gib": 4 * tokens * per_token / GIB,
        "kv_cache_memory_bytes": cache_bytes,
    }


def _parse(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"--prefix-lengths {text!r}: not a comma-separated list of integers"
        raise SystemExit(msg) from None
    if not out or any(n < 1 for n in out):
        raise SystemExit(f"--prefix-lengths {text!r}: lengths must be positive")
    return out


def _lengths(text: str | None, limit: int, max_tokens: int, block: int) -> list[int]:
    room = SUFFIX_LEN + max_tokens  # the suffix and the outputs share the context
    if text is None:
        if max(DEFAULT_LENGTHS) + room <= limit:
            return list(DEFAULT_LENGTHS)
        return [max(block, limit * k // 8 // block * block) for k in (1, 4, 6)]
    lengths = sorted(set(_parse(text)))
    over = [n for n in lengths if n + room > limit]
    if over:
        raise SystemExit(
            f"--prefix-lengths: {', '.join(map(str, over))} too long for this model: a prefix "
            f"plus the {SUFFIX_LEN}-token suffix and {max_tokens} output tokens must fit its "
            f"max_model_len ({limit}), so at most {limit - room}"
        )
    return lengths
