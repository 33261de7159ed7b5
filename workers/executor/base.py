"""Drives the tensor-parallel ranks: in-process for TP = 1, Ray worker actors for TP >= 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from workers.config import EngineConfig
from workers.executor.pending import PendingStep
from workers.messages.step import StepInput, StepOutput

if TYPE_CHECKING:
    from workers.lora.host_cache import AdapterCache


class Executor(Protocol):
    num_blocks: int
    # The worker's adapter host cache when it runs in the engine's process (None otherwise):
    # the engine's adapter check reads through it, so a slot load reads nothing again.
    lora_adapters: AdapterCache | None

    def execute(self, step: StepInput) -> StepOutput: ...
    # Starts the step and returns before its results reach the host, where the ranks allow.
    def launch(self, step: StepInput) -> PendingStep: ...
    def timing(self) -> dict[str, float]: ...
    def info(self) -> dict[str, str]: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...
    # Per rank, the launched step's exported KV blocks among `hashes` (hash -> bytes).
    def take_kv_exports(self, hashes: list[int]) -> list[dict[int, Any]]: ...


class InProcessExecutor:
    """TP = 1 without Ray: the worker lives in the engine's process (offline fast path)."""

    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        from workers.device.distributed import SINGLE
        from workers.device.platform import Platform
        from workers.device.worker import Worker

        platform = Platform.detect(config.device_type)
        self.worker = Worker(config, SINGLE, platform.torch_device(0), progress=progress)
        self.num_blocks = self.worker.available_kv_blocks()
        self.worker.init_kv_cache(self.num_blocks)
        lora = self.worker.lora
        self.lora_adapters = lora.adapters if lora is not None else None

    def execute(self, step: StepInput) -> StepOutput:
        out = self.worker.execute(step)
        assert out is not None
        return out

    def launch(self, step: StepInput) -> PendingStep:
        """The forward and sampling are queued on the device; the sampled tokens come back
        in one non-blocking copy that `result()` waits for (workers/device/worker.py)."""
        pending = self.worker.launch(step)
        assert pending is not None
        return pending

    def check_health(self) -> None:
        return None

    def take_kv_exports(self, hashes: list[int]) -> list[dict[int, Any]]:
        return [self.worker.kv_offload.take_exports(hashes)]

    def timing(self) -> dict[str, float]:
        return {**self.worker.timing(), "wall_s": self.worker.execute_s}

    def info(self) -> dict[str, str]:
        """What the worker runs, fixed at its start (`Worker.info`: the CPU kernels' state)."""
        return self.worker.info()

    def shutdown(self) -> None:
        self.worker = None  # type: ignore[assignment]


def create_executor(
    config: EngineConfig, progress: bool = False, use_ray: bool | None = None
) -> Executor:
    if use_ray is None:
        use_ray = config.parallel.tensor_parallel_size > 1
    if not use_ray:
        return InProcessExecutor(config, progress=progress)
    from workers.executor.ray_executor import RayExecutor

    return RayExecutor(config)
