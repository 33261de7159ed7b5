"""Tensor parallelism across Ray worker actors, one per rank, placed through a placement group.

The engine process drives every rank each step with the same small StepInput (a diff) and
gets the sampled tokens back from rank 0. All ranks are actors, so the engine never blocks
inside a collective itself: it waits on the ranks' results with a timeout (the watchdog). A
rank that dies or a step that does not finish in `step_timeout_s` fails the executor with an
error naming the rank, and the actors and the placement group are released.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.config import EngineConfig
from workers.executor.pending import Resolved
from workers.messages.step import StepInput, StepOutput

log = logging.getLogger(__name__)


class RankWorker:
    """One TP rank inside a Ray actor: joins the process group, then wraps a Worker."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.worker = None
        self._store: Any = None  # rank 0's rendezvous store, held from `address` to `init`

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address. Its store listens from here on, on a port the OS
        picked: a port chosen now and bound later could be taken in between by another
        process (ranks of other replicas starting on the same node)."""
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            host,
            0,
            self.config.parallel.tensor_parallel_size,
            is_master=True,
            wait_for_workers=False,
            timeout=self._timeout(),
        )
        return host, self._store.port

    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.config.parallel.step_timeout_s)

    def init(self, master: tuple[str, int]) -> int:
        import torch
        import torch.distributed as dist

        from workers.device.distributed import TPGroup
        from workers.device.platform import Platform
        from workers.device.worker import Worker

        platform = Platform.detect(self.config.device_type)
        size = self.config.parallel.tensor_parallel_size
        if platform.is_cuda:
            torch.cuda.set_device(0)  # Ray exposes only this actor's GPU
        store = self._store
        if store is None:  # ranks > 0 join rank 0's store
            store = dist.TCPStore(
                master[0], master[1], size, is_master=False, timeout=self._timeout()
            )
        dist.init_process_group(
            backend=platform.dist_backend,
            store=store,
            rank=self.rank,
            world_size=size,
            timeout=self._timeout(),
        )
        self.worker = Worker(self.config, TPGroup(self.rank, size), platform.torch_device(0))
        return self.worker.available_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute(self, step: StepInput) -> StepOutput | None:
        return self.worker.execute(step)

    def param_bytes(self) -> int:
        return self.worker.param_bytes()

    def timing(self) -> dict[str, float]:
        return self.worker.timing()

    def info(self) -> dict[str, str]:
        return self.worker.info()

    def ping(self) -> int:
        return self.rank

    def take_kv_exports(self, hashes: list[int]) -> dict:
        return self.worker.kv_offload.take_exports(hashes)


class RankFailedError(RuntimeError):
    pass


class RayExecutor:
    # Each rank reads an adapter itself when it first loads it (workers/lora/host_cache.py).
    lora_adapters = None

    def __init__(self, config: EngineConfig) -> None:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        self.timeout = config.parallel.step_timeout_s
        self._dead: str | None = None
        self.wall_s = 0.0
        self._owned_pg: PlacementGroup | None = None
        gpu = config.device_type == "cuda"
        pg = get_current_placement_group()
        in_replica = pg is not None and len(pg.bundle_specs) >= self.size
        if not in_replica:
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="STRICT_PACK")
            self._owned_pg = pg
            try:
                ray.get(pg.ready(), timeout=self.timeout)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                raise RuntimeError(
                    f"could not reserve {self.size} x {bundle} for tensor_parallel_size="
                    f"{self.size} within {self.timeout:.0f}s (not enough resources on one node)"
                ) from None
        remote = ray.remote(RankWorker)
        self.actors = []
        for rank in range(self.size):
            # Inside a Serve replica, bundle 0's CPU is the replica actor's own.
            cpus = 0 if (in_replica and rank == 0) else 1
            self.actors.append(
                remote.options(
                    num_cpus=cpus,
                    num_gpus=1 if gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=rank
                    ),
                    name=None,
                ).remote(config, rank)
            )
        t0 = time.perf_counter()
        try:
            # Start-up (imports, weight loading) may be slow; the step watchdog starts after it.
            startup = max(300.0, self.timeout)
            master = self._get([self.actors[0].address.remote()], "start-up", startup)[0]
            blocks = self._get([a.init.remote(master) for a in self.actors], "start-up", startup)
            self.num_blocks = min(blocks)
            self._get(
                [a.init_kv_cache.remote(self.num_blocks) for a in self.actors], "start-up", startup
            )
            # Fixed at the ranks' start: asked once (rank 0 speaks for the group).
            self._info = self._get([self.actors[0].info.remote()], "start-up", startup)[0]
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "TP group of %d ranks ready in %.1fs (%s)",
            self.size,
            time.perf_counter() - t0,
            "cuda/nccl" if gpu else "cpu/gloo",
        )

    def _get(self, refs: list, what: str, timeout: float | None = None) -> list:
        timeout = timeout or self.timeout
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            ranks = [i for i, r in enumerate(refs) if r not in done]
            raise self._fail(
                f"{what}: rank(s) {ranks} did not finish within {timeout:.0f}s"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise self._fail(f"{what}: rank {self._which(refs)} died ({type(e).__name__})") from e
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValueError):
                self._fail(f"{what}: {cause}")
                raise ValueError(str(cause)) from None
            raise self._fail(f"{what}: rank {self._which(refs)} failed: {cause}") from e

    def _which(self, refs: list) -> int | str:
        for i, r in enumerate(refs):
            try:
                ray.get(r, timeout=0)
            except Exception:  # noqa: BLE001 - looking for the failing rank
                return i
        return "?"

    def _fail(self, message: str) -> RankFailedError:
        self._dead = message
        log.error("tensor-parallel group failed: %s", message)
        self.shutdown()
        return RankFailedError(message)

    def execute(self, step: StepInput) -> StepOutput:
        if self._dead is not None:
            raise RankFailedError(self._dead)
        t0 = time.perf_counter()
        results = self._get([a.execute.remote(step) for a in self.actors], "step")
        self.wall_s += time.perf_counter() - t0
        return results[0]

    def launch(self, step: StepInput) -> Resolved:
        """Synchronous: only rank 0 samples, so the other ranks could not take a step's
        tokens from the device for the next one (async scheduling needs one rank)."""
        return Resolved(self.execute(step))

    def timing(self) -> dict[str, float]:
        """Rank 0's step and collective time plus the engine-side wall time of the steps;
        wall - execute is what the actor calls add per step."""
        rank0 = self._get([self.actors[0].timing.remote()], "timing")[0]
        return {**rank0, "wall_s": self.wall_s}

    def info(self) -> dict[str, str]:
        """Rank 0's `Worker.info` (the CPU kernels' state), read at start-up."""
        return self._info

    def param_bytes(self) -> list[int]:
        return self._get([a.param_bytes.remote() for a in self.actors], "param_bytes")

    def take_kv_exports(self, hashes: list[int]) -> list[dict]:
        return self._get([a.take_kv_exports.remote(hashes) for a in self.actors], "KV export")

    def check_health(self) -> None:
        if self._dead is not None:
            raise RankFailedError(self._dead)
        self._get([a.ping.remote() for a in self.actors], "health check")

    def shutdown(self) -> None:
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._owned_pg is not None:
            try:
                remove_placement_group(self._owned_pg)
            except Exception:  # noqa: BLE001
                pass
            self._owned_pg = None
