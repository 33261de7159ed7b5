"""One tensor-parallel rank: its weight shard, its KV-cache shard, and the model runner.

The same class runs in-process (TP = 1, offline fast path) and inside a Ray actor (TP >= 1).
Only the driver rank (0) samples; every rank runs the forward pass in lockstep.
"""

from __future__ import annotations

import logging
import time

import torch

from workers.config import EngineConfig
from workers.device.attention_backend import AttentionBackend
from workers.device.compile import CompiledForward
from workers.device.decode_graphs import FullGraphForward
from workers.device.distributed import TPGroup
from workers.device.forward import build_forward
from workers.device.host_memory import anon_rss_bytes, peak_rss_bytes, rss_bytes
from workers.device.in_flight import PendingOutput, SampledTokens, fill_placeholders
from workers.device.kv_offload import KvOffload
from workers.device.layers.moe import SparseMoeBlock
from workers.device.layers.sampler import SamplerOutput, greedy_tokens
from workers.device.loader import load_weights
from workers.device.model_runner import ModelInput, SeqState, prepare_inputs, sample_positions
from workers.device.models import build_model
from workers.device.penalty_counts import PenaltyCounts
from workers.device.scoring import ScoringOutputs, scoring_outputs
from workers.device.step_buffers import StepBuffers
from workers.device.triton_inputs import (
    DecodePadding,
    buffer_capacity,
    prepare_triton_inputs,
    table_width,
)
from workers.kv_layout import kv_block_bytes
from workers.messages.step import GrammarBitmask, StepInput, StepOutput
from workers.quantization import describe as describe_quantization

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
# How often the driver reports the experts' loads (EngineStats.moe_expert_tokens): a host
# sync, so not every step; metrics are scraped every few seconds anyway.
EXPERT_REPORT_S = 1.0


class Worker:
    def __init__(
        self, config: EngineConfig, tp: TPGroup, device: torch.device, progress: bool = False
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.is_driver = tp.rank == 0
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        rss_before, anon_before = rss_bytes(), anon_rss_bytes()
        torch.manual_seed(config.seed)
        with torch.device(device):
            self.model = build_model(
                config.model, tp, config.torch_dtype, config.scheduler.max_model_len
            )
        load_weights(self.model, config.model, tp, progress=progress)
        self.model.eval()
        # Peak host memory the load added (sharded loading keeps it near one shard).
        self.load_peak_rss_bytes = max(0, peak_rss_bytes() - rss_before)
        self.load_anon_bytes = max(0, anon_rss_bytes() - anon_before)
        log.info(
            "rank %d/%d: loaded %s (quantization: %s; %.1f M params on this rank) in %.2fs",
            tp.rank,
            tp.size,
            config.model.architecture,
            describe_quantization(config.model.quantization),
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            time.perf_counter() - t0,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_offload: KvOffload | None = None  # the host KV tier's pool (this rank's shard)
        self.steps = 0
        self.execute_s = 0.0
        self.states: dict[str, SeqState] = {}
        # The driver's last sampled tokens, on the device (workers/device/in_flight.py).
        self.last_sampled: SampledTokens | None = None
        from workers.device.layers.sampler import Sampler

        self.sampler = Sampler(seed=config.seed)
        # Penalised sequences' token counts on the device, made at the first such sequence.
        self.penalty_counts: PenaltyCounts | None = None
        # LoRA adapters' device slots (None: the base model only), before the forward is built:
        # the direct kernel calls read each projection's slots (workers/lora/layers.py).
        # Mixture-of-experts layers, whose tokens per expert the driver reports to the engine.
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        self._expert_report_t = 0.0
        self.lora = None
        if config.lora is not None:
            from workers.lora.device import LoraDevice

            self.lora = LoraDevice(self.model, config, tp)
        self.attention_backend = AttentionBackend.choose(config.attention_backend, device.type)
        log.info("Attention backend: %s", self.attention_backend)
        triton = self.attention_backend.name == "triton"
        self.forward, self.packed_bytes = build_forward(
            self.model, config, device, tp.size, progress, triton
        )
        log.info("CPU kernels: %s", self.forward.strategy.kernels)
        # The library the attention metadata hands the kernels (None: torch's paths). Their
        # attention reads a float32 cache only: an FP8 one goes through torch's (GEMMs stay).
        fp8_kv = config.cache.kv_cache_dtype == "fp8"
        self.cpu_kernel = None if fp8_kv else self.forward.strategy.kernels.lib
        # Query tokens per triton program (0: the torch path); the triton backend takes every
        # row's attention, so the CPU kernels' attention rows are off (their GEMMs stay on).
        # Its step inputs go through one persistent buffer (made with the KV cache).
        self.triton_block_q = 0
        self.step_buffers: StepBuffers | None = None
        self.decode_padding: DecodePadding | None = None  # what the decode graphs serve
        self.progress = progress
        if triton:
            self.triton_block_q = _triton_block_q(self.model)
            self.cpu_kernel = None
            # The eager modules' norms, rotary, activations and residual adds on Triton too
            # (workers/device/layers/triton_layers.py); the compiled pieces and the CPU
            # kernels (CPU only, under the interpreter) keep theirs.
            if not isinstance(self.forward.compiled, CompiledForward) and not (
                self.forward.strategy.kernels.on
            ):
                from workers.device.layers.triton_layers import use_triton_layers

                use_triton_layers(self.model)
        # Start-up seconds the compiled forward cost; None: it runs eagerly.
        self.compile_s = None if self.forward.compiled is None else self.forward.compiled.compile_s

    def param_bytes(self) -> int:
        """The weights' bytes in memory: the parameters (a freed float32 weight is a meta
        tensor and counts nothing) and the packed bfloat16 copies."""
        tensors = {id(p): p for p in self.model.parameters() if not p.is_meta}
        for module in self.model.modules():
            packed = getattr(module, "packed_weight", None)
            if packed is not None:
                tensors[id(packed)] = packed
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def available_kv_blocks(self) -> int:
        per_block = kv_block_bytes(self.config, self.tp.size)
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.cache.gpu_memory_utilization)
            else:
                budget = _CPU_DEFAULT_KV_BYTES
        return max(0, budget // per_block)

    def init_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        shape = (num_blocks, self.block_size, m.kv_heads_per_rank(self.tp.size), m.head_dim)
        # Zeroed, not empty: padded decode rows read unused slots, and garbage NaNs there would
        # poison the masked softmax (0 * NaN = NaN).
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.config.kv_torch_dtype, device=self.device),
                torch.zeros(shape, dtype=self.config.kv_torch_dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        if self.config.cache.kv_offload_gib > 0:
            self.kv_offload = KvOffload(self.kv_caches, self.device, self.tp.rank)
        if self.triton_block_q:
            self._init_step_buffers(num_blocks)

    def _init_step_buffers(self, num_blocks: int) -> None:
        """The triton backend's step buffer, sized for the largest step, and (when compiled)
        the decode graphs over it and the KV cache."""
        sched = self.config.scheduler
        width = table_width(sched.max_model_len, self.block_size, num_blocks)
        capacity = buffer_capacity(sched.max_num_batched_tokens, sched.max_num_seqs, width)
        self.step_buffers = StepBuffers(capacity, self.device)
        compiled = self.forward.compiled
        if isinstance(compiled, FullGraphForward):
            compiled.capture(
                self.model,
                self.kv_caches,
                self.step_buffers,
                width,
                self.triton_block_q,
                self.progress,
            )
            self.decode_padding = compiled.graphs.padding
            self.compile_s = compiled.compile_s

    def _apply(self, step: StepInput) -> list[SeqState]:
        states = self.states
        counts = self.penalty_counts
        for sid in step.removed:
            states.pop(sid, None)
            if counts is not None:
                counts.release(sid)
        order: list[SeqState] = []
        for n in step.new:
            s = SeqState(
                n.seq_id,
                len(n.prompt_token_ids),
                list(n.token_ids),
                n.params,
                list(n.block_ids),
                n.num_computed_tokens,
                n.num_scheduled,
                n.lora_slot,
            )
            states[n.seq_id] = s
            if counts is not None:  # sent whole again: its counts come from its tokens
                counts.release(n.seq_id)
            order.append(s)
        for c in step.cached:
            s = states[c.seq_id]
            if c.new_token_ids or c.draft_token_ids:
                s.receive(c.new_token_ids, c.draft_token_ids)
            if c.new_block_ids:
                s.block_ids.extend(c.new_block_ids)
            s.num_computed_tokens = c.num_computed_tokens
            s.num_scheduled = c.num_scheduled
            order.append(s)
        return order

    def timing(self) -> dict[str, float]:
        """Cumulative: steps run, seconds inside execute(), seconds inside collectives."""
        return {
            "steps": self.steps,
            "execute_s": self.execute_s,
            "collective_s": self.tp.stats.seconds,
            "load_peak_rss_bytes": self.load_peak_rss_bytes,
            "load_anon_bytes": self.load_anon_bytes,
            "param_bytes": self.param_bytes(),
            **({} if self.compile_s is None else {"compile_s": self.compile_s}),
        }

    def info(self) -> dict[str, str]:
        """What this rank runs, fixed at its start: the CPU kernels' state (`KernelState`,
        e.g. "on (AMX)" or "off: CUDA device") and the forward path."""
        return {"cpu_kernels": str(self.forward.strategy.kernels), "forward": self.forward.path}

    def execute(self, step: StepInput) -> StepOutput | None:
        """Runs one step and returns its output (None on the other ranks)."""
        pending = self.launch(step)
        return None if pending is None else pending.result()

    def launch(self, step: StepInput) -> PendingOutput | None:
        """Queues one step's forward and sampling on the device and starts its results'
        copy to the host, without waiting for either (workers/device/in_flight.py)."""
        t0 = time.perf_counter()
        try:
            load_s = self._load_loras(step)
            if step.kv_transfers is not None:  # before the forward that reads restored blocks
                self.kv_offload.apply(step.kv_transfers)
            pending = self._execute(step)
            if pending is not None:
                pending.lora_load_s = load_s
                pending.expert_tokens = self._expert_tokens_report(step.report_experts)
            return pending
        finally:
            self.steps += 1
            self.execute_s += time.perf_counter() - t0

    @torch.inference_mode()
    def _execute(self, step: StepInput) -> PendingOutput | None:
        order = self._apply(step)
        if not order:
            return PendingOutput([], None, None, ScoringOutputs()) if self.is_driver else None
        if self.step_buffers is not None:
            inp = prepare_triton_inputs(
                order, self.block_size, self.triton_block_q, self.step_buffers, self.decode_padding
            )
        else:
            inp = prepare_inputs(order, self.block_size, self.device, self.cpu_kernel)
        fill_placeholders(inp, self.last_sampled)
        if inp.lora_rows:
            # Steps with adapter rows run eagerly (modules or direct kernel calls, whose
            # projections add the deltas); the compiled pieces serve base-model steps only.
            self.lora.batch.set(
                inp.lora_rows, len(inp.input_ids), self.device, self.config.torch_dtype
            )
            try:
                x = self.forward.eager_hidden_states(
                    inp.input_ids, inp.positions, self.kv_caches, inp.meta
                )
            finally:
                self.lora.batch.clear()
        else:
            x = self.forward.hidden_states(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        # Every rank takes the same branch (the same inputs): the LM head's gather is a
        # collective under tensor parallelism.
        logits = self.model.logits(x, inp.logits_indices) if len(inp.logits_indices) else None
        pending = self._sample(step, inp, x, logits) if self.is_driver else None
        # After the sampling batch read the sequences' tokens so far: this step's go after.
        for s in dict.fromkeys(inp.sample_states):  # a draft's rows share one state
            s.add_placeholder()
        return pending

    def _sample(
        self,
        step: StepInput,
        inp: ModelInput,
        x: torch.Tensor,
        logits: torch.Tensor | None,
    ) -> PendingOutput:
        """The driver's part: prompt logprobs and embeddings, then the sampled tokens, whose
        copy to the host starts here (and which the next step may read on the device)."""
        extras = scoring_outputs(self.model, x, logits, inp)
        rows = inp.sample_states
        ids = [s.seq_id for s in rows]
        if not rows:
            return PendingOutput([], None, None, extras)
        logits = logits[: len(rows)]
        grammar = _grammar_rows(step.grammar, ids)
        batch = None
        if all(s.plain_greedy for s in rows):
            if grammar is not None:  # greedy under a grammar: the argmax of allowed tokens
                from workers.device.layers.logits_processors import mask_disallowed

                rows_t = torch.tensor(grammar[0], dtype=torch.long, device=logits.device)
                bits = grammar[1].to(logits.device, non_blocking=True)
                logits = mask_disallowed(logits.float(), rows_t, bits)
            sampled = SamplerOutput(greedy_tokens(logits), None, None)
        else:
            from workers.device.layers.sampling_batch import SamplingBatch, upload

            penalised = [k for k, s in enumerate(rows) if s.params.has_penalties]
            tables, slot_t = self._penalty_tables([rows[k] for k in penalised], logits)
            batch = SamplingBatch.assemble(
                [s.params for s in rows],
                sample_positions(rows),
                tables,
                device=logits.device,
                vocab_size=logits.shape[-1],
                grammar=grammar,
            )
            sampled = self.sampler(logits.float(), batch)
            if slot_t is not None:
                rows_t = upload(torch.tensor(penalised, dtype=torch.long), logits.device)
                self.penalty_counts.record(slot_t, rows_t, sampled.token_ids)
        self.last_sampled = SampledTokens(sampled.token_ids, {sid: k for k, sid in enumerate(ids)})
        return PendingOutput(ids, sampled.start_to_host(), batch, extras)

    def _penalty_tables(
        self, rows: list[SeqState], logits: torch.Tensor
    ) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], torch.Tensor | None]:
        """The penalised rows' token tables from the device (workers/device/penalty_counts.py)
        and their slots there; ((None, None), None) without such rows."""
        if not rows:
            return (None, None), None
        if self.penalty_counts is None:
            self.penalty_counts = PenaltyCounts(logits.shape[-1], logits.device)
        slot_t, counts, mask = self.penalty_counts.tables(rows)
        return (counts, mask), slot_t

    def _expert_tokens_report(self, now: bool = False) -> tuple[tuple[int, ...], ...] | None:
        """Every sparse layer's tokens per expert, about once a second (one host sync), or
        `now` (the engine went idle)."""
        if not self.moe_layers:
            return None
        if not now and time.monotonic() - self._expert_report_t < EXPERT_REPORT_S:
            return None
        self._expert_report_t = time.monotonic()
        counts = torch.stack([m.expert_tokens for m in self.moe_layers]).tolist()
        return tuple(tuple(row) for row in counts)

    def _load_loras(self, step: StepInput) -> float:
        """Puts the step's new adapters into their slots; returns the seconds it took."""
        if not step.lora_loads:
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for slot, req in step.lora_loads:
                self.lora.load(slot, req)
        return time.perf_counter() - t0


def _triton_block_q(model: torch.nn.Module) -> int:
    """The triton backend's query tokens per program, from the model's (this rank's) heads."""
    from workers.device.layers.attention import PagedAttention
    from workers.device.layers.triton_metadata import block_q_for

    attn = next(m for m in model.modules() if isinstance(m, PagedAttention))
    return block_q_for(attn.num_heads, attn.num_kv_heads)


def _grammar_rows(
    grammar: GrammarBitmask | None, ids: list[str]
) -> tuple[list[int], torch.Tensor] | None:
    """The sampled rows that have a grammar, and their bitmask rows in the same order."""
    if grammar is None:
        return None
    where = {sid: i for i, sid in enumerate(grammar.seq_ids)}
    rows = [r for r, sid in enumerate(ids) if sid in where]
    if not rows:
        return None
    picked = [where[ids[r]] for r in rows]
    bits = grammar.bits if picked == list(range(len(grammar.seq_ids))) else grammar.bits[picked]
    return rows, torch.from_numpy(bits)
