"""One replica of `kvray bench kv-tier`: an AsyncEngine and, when the tier is attached, the
replica's side of the cluster KV tier (cluster/replica/kv_share.py), as LLMServer holds
them, in a Ray actor of its own (no Serve around it: the bench times the tier, not routing).

Every replica's engine has the same configuration (host tier, KV events, block export), so
all of them compute the same greedy tokens; a replica without the tier simply never calls
`KvShare.attach`. A request's TTFT is timed inside the actor, from the moment it arrives
(before the pull decision and the pull) to its first streamed token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from cluster.replica.kv_cost import PRIOR_PREFILL_TOKENS_PER_S, PullCost
from workers.core.block_hash import prompt_block_hashes

# A prefill prior slow enough that the cost model always pulls (the forced arms).
FORCED_PREFILL_TOKENS_PER_S = 1.0
# How long to wait for a context's blocks to reach the directory.
PUBLISH_WAIT_S = 60.0


class TierReplica:
    async def __init__(self, engine_kwargs: dict[str, Any], threads: int) -> None:
        import torch

        from workers import AsyncEngine, EngineArgs

        # Ray gives an actor of no CPUs one thread; the arms run one at a time, so each may
        # use the machine's cores (the same for every arm).
        torch.set_num_threads(threads)
        self.config = EngineArgs(**engine_kwargs).create_config()
        self.engine = AsyncEngine(self.config)
        self.share: Any = None
        self.forced = False
        self._ids = 0

    def describe(self) -> dict[str, Any]:
        return {
            "max_model_len": self.engine.max_model_len,
            "device": self.config.device_type,
            "dtype": self.config.dtype,
        }

    def join(self, app: str, capacity_bytes: int, forced: bool) -> dict[str, Any]:
        """Attaches application `app`'s tier; `forced`: a cost model that always pulls."""
        from cluster.replica.kv_directory import directory_actor
        from cluster.replica.kv_share import KvShare
        from cluster.replica.kv_store import node_store
        from workers.kv_layout import kv_block_bytes, kv_layout_key

        tp = self.config.parallel.tensor_parallel_size
        directory = directory_actor(app, capacity_bytes)
        cost = PullCost(prefill_tokens_per_s=FORCED_PREFILL_TOKENS_PER_S) if forced else PullCost()
        self.share = KvShare(
            directory,
            node_store(app, directory),
            kv_layout_key(self.config),
            self.config.cache.block_size,
            kv_block_bytes(self.config, tp) * tp,
            cost=cost,
        )
        self.forced = forced
        self.engine.kv_listener = None
        self.share.listen(self.engine)
        return {"layout": self.share.layout, "block_bytes": self.share.block_bytes}

    def unforce(self) -> dict[str, Any]:
        """A forced replica's cost model turned into the learned one: the prefill prior in
        place of the forced one (it never measured a prefill: a forced replica always pulls),
        the pull rates it measured kept; from now on it learns from its requests."""
        self.share.cost.prefill_tokens_per_s = PRIOR_PREFILL_TOKENS_PER_S
        self.forced = False
        return self.share.stats()

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        resumed: list[int] | None = None,
        stop_after: int | None = None,
        learn: bool = True,
    ) -> dict[str, Any]:
        """One greedy request, streamed. `resumed`: the outputs an earlier replica streamed
        before it stopped (the request continues from them); `stop_after`: abort it once it
        streamed that many tokens (a replica stopped mid-stream); `learn`: whether the cost
        model learns from it."""
        from workers import SamplingParams
        from workers.inputs import ResumedSample
        from workers.outputs import RequestOutputKind

        t0 = time.perf_counter()
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        checker = self.engine.input_checker
        inp = checker.request(params).input(prompt)
        if resumed:
            inp = checker.check_resume(inp, [ResumedSample(0, tuple(resumed), 0)])
        estimate = self._estimate(len(prompt) + len(resumed or ()))
        before = dict(self.share.outcomes) if self.share is not None else {}
        self._ids += 1
        rid = f"kv-tier-{self._ids}"
        if self.share is not None:
            # The learned model completes a pull's cost from the request's first token.
            inp = await self.share.attach(inp, None if self.forced else rid)
        attach_s = time.perf_counter() - t0
        tokens: list[int] = []
        ttft = None
        final = None
        stream = self.engine.generate_input(inp, rid)
        async with contextlib.aclosing(stream):  # closing early aborts the request
            async for out in stream:
                if ttft is None and out.outputs and out.outputs[0].delta_token_ids:
                    ttft = time.perf_counter() - t0
                if out.outputs:
                    tokens += out.outputs[0].delta_token_ids
                if out.finished:
                    final = out
                if stop_after is not None and len(tokens) >= stop_after:
                    break
        if final is not None and self.share is not None and not self.forced and learn:
            self.share.observe_finished(final)  # the learned cost model's rates
        outcome = None
        if self.share is not None:
            outcome = next((k for k, v in self.share.outcomes.items() if v != before[k]), None)
        return {
            "ttft_s": ttft,
            "attach_s": attach_s,
            "tokens": tokens[:stop_after] if stop_after is not None else tokens,
            "pulled_blocks": len(inp.kv_blocks),
            "cached_tokens": final.num_cached_tokens if final is not None else None,
            "outcome": outcome,
            **estimate,
        }

    def _estimate(self, context_len: int) -> dict[str, float]:
        """The cost model's figures, before the request, for every full block of a context
        of `context_len` tokens: what it compares when nothing is cached here."""
        if self.share is None:
            return {}
        n = (context_len - 1) // self.share.block_size
        cost = self.share.cost
        return {
            "est_pull_s": cost.pull_seconds(n * self.share.block_bytes),
            "est_compute_s": cost.compute_seconds(n * self.share.block_size),
        }

    async def wait_published(self, ids: list[int], timeout_s: float = PUBLISH_WAIT_S) -> int:
        """Waits until the directory lists every full block of context `ids` (the publishing
        thread and the store put them on their own time), at most `timeout_s`; the number
        listed."""
        hashes = prompt_block_hashes(ids, self.share.block_size, len(ids))
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self.share.directory.lookup.remote(self.share.layout, hashes)
            if len(found) == len(hashes) or time.monotonic() > deadline:
                return len(found)
            await asyncio.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        return self.share.stats() if self.share is not None else {}

    def shutdown(self) -> None:
        if self.share is not None:
            self.share.close()
        self.engine.shutdown()
