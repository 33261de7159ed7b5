"""A worker's adapters: the slots attached to its model's projections, the adapters read from
disk (a bounded host cache, workers/lora/host_cache.py), and loading one into a slot (this
rank's shard of it).

The engine core decides which adapter sits in which slot (workers/lora/slots.py) and tells
the workers in the step that first needs it (`StepInput.lora_loads`); a worker loads it
before that step's forward. Every rank reads the adapter file itself, as it reads its shard of
the base weights (a path every rank can see, like the model directory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from workers.config import EngineConfig
from workers.device.distributed import TPGroup
from workers.lora.checkpoint import LoraAdapter
from workers.lora.host_cache import AdapterCache
from workers.lora.layers import LoraBatch, LoraSlots
from workers.lora.request import LoRARequest

_Part = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class _Target:
    """One LoRA-capable linear layer and how an adapter's modules map onto it."""

    layer: int
    slots: LoraSlots
    modules: tuple[str, ...]  # its fused parts' module names (q, k, v) or (o,)
    rows: tuple[tuple[int, int], ...]  # column-parallel: each part's (start, size) of B's rows
    cols: tuple[int, int] | None  # row-parallel: this rank's (start, size) of A's columns


class LoraDevice:
    """The adapter slots of one worker's model (module doc)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, tp: TPGroup) -> None:
        assert config.lora is not None
        self.config = config
        self.lora = config.lora
        self.batch = LoraBatch()
        self.targets = _attach(model, config, tp, self.batch)
        # Read from disk and checked; the engine core's check shares it when in this process.
        self.adapters = AdapterCache(config.model, self.lora.max_lora_rank, self.lora.max_cpu_loras)
        self.slot_ids: list[int | None] = [None] * self.lora.max_loras
        self.load_seconds = 0.0
        self.loads = 0

    def load(self, slot: int, req: LoRARequest) -> None:
        """Puts `req`'s adapter into `slot` (replacing whatever was there)."""
        t0 = time.perf_counter()
        adapter = self.adapters.get(req)
        for t in self.targets:
            t.slots.write(slot, [_shard(adapter, t, name, i) for i, name in enumerate(t.modules)])
        self.slot_ids[slot] = req.lora_int_id
        self.loads += 1
        self.load_seconds += time.perf_counter() - t0


def _shard(adapter: LoraAdapter, t: _Target, name: str, part: int) -> _Part:
    m = adapter.modules.get((t.layer, name))
    if m is None:
        return None
    a, b = m.a, m.b
    if t.cols is not None:
        start, size = t.cols
        a = a[:, start : start + size]
    else:
        start, size = t.rows[part]
        b = b[start : start + size]
    return a, b


def _attach(
    model: torch.nn.Module, config: EngineConfig, tp: TPGroup, batch: LoraBatch
) -> list[_Target]:
    """Gives every projection of every layer its slots (MoE experts have none: a sparse layer's
    MLP takes no adapter, workers/lora/checkpoint.py refuses one)."""
    c, lora = config.model, config.lora
    assert lora is not None
    hd = c.head_dim
    q_per = c.num_heads // tp.size * hd
    kvh = c.kv_heads_per_rank(tp.size)
    if tp.size >= c.num_kv_heads:  # replicated KV heads: this rank's one head (the loader's)
        kv_start = (tp.rank // (tp.size // c.num_kv_heads)) * hd
    else:
        kv_start = tp.rank * kvh * hd
    kv_per = kvh * hd
    inter = c.intermediate_size // tp.size
    dtype, device = config.torch_dtype, next(model.parameters()).device
    lib = None
    if config.cpu_kernels and device.type == "cpu" and dtype == torch.float32:
        from workers.device.layers.cpu_kernels import kernel

        lib = kernel()  # None where it cannot be built: the torch paths serve

    def slots(linear: torch.nn.Module, in_features: int, out_sizes: list[int]) -> LoraSlots:
        n, rank = lora.max_loras, lora.max_lora_rank
        s = LoraSlots(batch, n, in_features, out_sizes, rank, dtype, device)
        s.lib = lib
        linear.lora = s
        return s

    targets: list[_Target] = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv = slots(attn.qkv_proj, c.hidden_size, [q_per, kv_per, kv_per])
        rows = ((tp.rank * q_per, q_per), (kv_start, kv_per), (kv_start, kv_per))
        targets.append(_Target(i, qkv, ("q_proj", "k_proj", "v_proj"), rows, None))
        o = slots(attn.o_proj, q_per, [c.hidden_size])
        targets.append(_Target(i, o, ("o_proj",), (), (tp.rank * q_per, q_per)))
        mlp = layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # a sparse (experts) layer
            continue
        gu = slots(mlp.gate_up_proj, c.hidden_size, [inter, inter])
        rows = ((tp.rank * inter, inter), (tp.rank * inter, inter))
        targets.append(_Target(i, gu, ("gate_proj", "up_proj"), rows, None))
        down = slots(mlp.down_proj, inter, [c.hidden_size])
        targets.append(_Target(i, down, ("down_proj",), (), (tp.rank * inter, inter)))
    return targets
