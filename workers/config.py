"""Frozen configs, built once at the edge (EngineArgs -> EngineConfig) and passed down."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from workers.cache_config import DEFAULT_BLOCK_SIZE, CacheConfig
from workers.compile_config import CompilationConfig
from workers.gemma_config import GEMMA_ARCHITECTURES, GemmaConfig, with_gemma_defaults
from workers.hf_config import eos_ids, read_config, settled_config
from workers.lora.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraConfig
from workers.moe_config import MOE_ARCHITECTURES, MoeConfig
from workers.quantization import QuantizationConfig, check_quantized_tensor_parallel
from workers.rope_config import RopeConfig
from workers.spec_decode.config import SpeculativeConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
    *GEMMA_ARCHITECTURES,
)

# Defaults written once; EngineArgs, the configs and `LLM(...)` point here.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # token budget of one engine step
DEFAULT_STEP_TIMEOUT_S = 20.0
DEFAULT_GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (LRU), keyed by the constraint
DEFAULT_GRAMMAR_TIMEOUT_S = 30.0
# A waiting request gains one priority level per this many seconds waited: a request is
# overtaken by more urgent ones for at most (its priority - theirs) * this (no starvation).
DEFAULT_PRIORITY_AGING_S = 10.0

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig
    checkpoint_dtype: str = "float32"
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (workers/moe_config.py)
    gemma: GemmaConfig | None = None  # Gemma 3 layers (workers/gemma_config.py)
    quantization: QuantizationConfig | None = None  # None: full precision (workers/quantization.py)
    tokenizer: str | None = None  # where the tokenizer is read from; None: `path`

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads split across ranks; replicated when there are more ranks than KV heads."""
        if tp_size >= self.num_kv_heads:
            if tp_size % self.num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp_size}) must be a multiple of "
                    f"num_key_value_heads ({self.num_kv_heads}) when it exceeds it"
                )
            return 1
        if self.num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) is not divisible by "
                f"tensor_parallel_size ({tp_size})"
            )
        return self.num_kv_heads // tp_size

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raises ValueError naming what does not split across `tp_size` ranks."""
        if self.num_heads % tp_size:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not divisible by "
                f"tensor_parallel_size ({tp_size})"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"intermediate_size ({self.intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({tp_size})"
            )
        self.kv_heads_per_rank(tp_size)
        if self.moe is not None:
            self.moe.check_tensor_parallel(tp_size)
        check_quantized_tensor_parallel(self, tp_size)

    @staticmethod
    def from_pretrained(
        path: str | Path, quant: str = "auto", tokenizer: str | None = None
    ) -> ModelConfig:
        """`quant`: EngineArgs.quantization (workers/quantization.py); `tokenizer`: its."""
        path = Path(path)
        cfg, cfg_file = read_config(path, tokenizer)  # a GGUF file's metadata, or config.json
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r} in {cfg_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"{cfg_file} is missing {', '.join(missing)}")
        # Every setting as transformers reads it, whichever version wrote the file (first
        # our checks of Gemma's layer types, whose refusal names the field).
        cfg = with_gemma_defaults(arch, settled_config(arch, with_gemma_defaults(arch, cfg)))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        raw_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        sliding = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get(
            "use_sliding_window", False
        ):
            sliding = None
        gemma = GemmaConfig.from_hf(arch, cfg)
        return ModelConfig(
            path=str(path),
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Qwen3 have them only with attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or gemma is not None,
            rope=gemma.global_rope if gemma else RopeConfig.from_hf(cfg),
            checkpoint_dtype=_DTYPES.get(raw_dtype.replace("torch.", ""), "float32"),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids(path, cfg),
            moe=MoeConfig.from_hf(arch, cfg, int(cfg["num_hidden_layers"])),
            gemma=gemma,
            quantization=QuantizationConfig.from_hf(arch, cfg.get("quantization_config"), quant),
            tokenizer=tokenizer,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # True when the user asked for max_model_len: it must then fit the KV cache (an error
    # otherwise); the checkpoint's default is capped to the KV cache instead (fit_to_kv_cache).
    max_model_len_explicit: bool = False
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    # Schedule step N+1 while step N runs on the device (EngineArgs.async_scheduling).
    async_scheduling: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Watchdog: a step (or a collective) that does not finish in this time fails the engine
    # with an error naming the rank, instead of hanging it.
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S


@dataclass(frozen=True)
class StructuredConfig:
    """Constrained decoding (workers.structured)."""

    # Compiled grammars kept, least recently used evicted first.
    grammar_cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE
    # A request whose grammar is not compiled by then ends (finish_reason "abort").
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S


# EngineArgs.attention_backend (workers/device/attention_backend.py).
ATTENTION_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class EngineArgs:
    """User-facing knobs; the same names as `LLM(...)` keyword arguments."""

    model: str | None = None  # None: the built-in demo checkpoint
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    seed: int = 0
    device: str | None = None
    served_model_name: str | None = None
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    grammar_cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S
    kv_events: bool = False  # record prefix-cache KV events (workers/core/kv_events.py)
    compile: bool | None = None  # compiled forward pass; None: where it was measured to win
    # Steps of fewer tokens run eagerly when compiled; None: the device's measured default.
    compile_min_tokens: int | None = None
    # The CPU C kernels (workers/device/layers/cpu_kernels) where they apply; False: torch's ops.
    cpu_kernels: bool = True
    # "auto" | "triton" | "torch" (workers/device/attention_backend.py).
    attention_backend: str = "auto"
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    # Mixture-of-experts models: split the experts across the TP ranks (whole experts per
    # rank) instead of slicing every expert (workers/device/layers/moe.py ExpertPartition).
    enable_expert_parallel: bool = False
    # LoRA adapters (workers/lora/): requests may name one (EngineInput.lora); the device
    # holds `max_loras` of them at once, of rank <= `max_lora_rank`.
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None  # None: max(DEFAULT_MAX_CPU_LORAS, max_loras)
    # Launch step N+1 before step N's tokens reach the host (workers/core/engine.py).
    async_scheduling: bool = False
    # GiB of host memory keeping evicted prefix-cache blocks (workers/core/host_tier.py); 0: off.
    kv_offload_gib: float = 0.0
    kv_share: bool = False  # CacheConfig.kv_share
    quantization: str = "auto"  # "auto" | "none" | "fp8": workers/quantization.py
    kv_cache_dtype: str = "auto"  # CacheConfig.kv_cache_dtype: "auto" | "fp8"
    # Speculative decoding: vLLM's JSON (text or dict; workers/spec_decode/config.py).
    speculative_config: str | dict | None = None
    tokenizer: str | None = None  # a tokenizer directory; None: the model's (a GGUF's own)

    def create_config(self) -> EngineConfig:
        from workers.device.platform import Platform

        model_path = self.model
        if model_path is None:
            from workers.demo import demo_model_dir

            model_path = str(demo_model_dir())
        model = ModelConfig.from_pretrained(model_path, self.quantization, self.tokenizer)
        if self.enable_expert_parallel:
            if model.moe is None:
                raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
            model = replace(model, moe=replace(model.moe, expert_parallel=True))
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "grammar_cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("grammar_timeout_s", "priority_aging_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise ValueError(f"{name} must be a number > 0, got {t!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.async_scheduling and self.tensor_parallel_size != 1:
            raise ValueError(  # only rank 0 samples: the others cannot read a step's tokens
                f"async_scheduling needs tensor_parallel_size 1, got {self.tensor_parallel_size}"
            )
        limit = model.max_position_embeddings
        if model.sliding_window:
            # No sliding-window attention kernel: cap the context so full attention is exact.
            limit = min(limit, model.sliding_window)
        max_model_len = self.max_model_len or limit
        if max_model_len > limit:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's limit ({limit})")
        # Fail at start-up, before any actor is spawned, when the heads do not divide.
        model.check_tensor_parallel(self.tensor_parallel_size)
        batched = self.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, self.block_size
        )
        platform = Platform.detect(self.device)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_events=self.kv_events,
                kv_offload_gib=self.kv_offload_gib,
                kv_share=self.kv_share,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len_explicit=self.max_model_len is not None,
                priority_aging_s=self.priority_aging_s,
                async_scheduling=bool(self.async_scheduling),
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, step_timeout_s=self.step_timeout_s
            ),
            structured=StructuredConfig(
                grammar_cache_size=self.grammar_cache_size,
                grammar_timeout_s=float(self.grammar_timeout_s),
            ),
            device_type=platform.device_type,
            dtype=str(platform.resolve_dtype(self.dtype, _torch_dtype(model.checkpoint_dtype))),
            seed=self.seed,
            served_model_name=self.served_model_name or Path(model_path).name,
            compilation=CompilationConfig.resolve(
                self.compile, platform.device_type, self.max_num_seqs, self.compile_min_tokens
            ),
            cpu_kernels=bool(self.cpu_kernels),
            attention_backend=self.attention_backend,
            lora=LoraConfig.from_args(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora
            else None,
            speculative=SpeculativeConfig.parse(self.speculative_config),
        )


def fit_to_kv_cache(config: EngineConfig, kv_cache_tokens: int) -> EngineConfig:
    """The config with max_model_len no larger than `kv_cache_tokens`, the tokens the KV cache
    can hold for one sequence (known only once the executor has sized the cache).

    A sequence longer than the cache could never run to its end: preempting everything else
    would not give it room. The behaviour chosen (as vLLM users expect from its message):
    - max_model_len from the checkpoint (the user set none): capped to the cache, with a
      warning naming both numbers and how to raise the cache, so a small cache still serves;
    - max_model_len the user asked for: ValueError naming both numbers, because silently
      serving less context than requested would surprise them later.
    """
    limit = config.scheduler.max_model_len
    if limit <= kv_cache_tokens:
        return config
    if config.scheduler.max_model_len_explicit:
        raise ValueError(
            f"max_model_len ({limit}) is larger than the {kv_cache_tokens} tokens the KV cache "
            "can hold for one sequence; raise kv_cache_memory_bytes (--kv-cache-memory) "
            "or lower max_model_len"
        )
    log.warning(
        "max_model_len %d is larger than the %d tokens the KV cache can hold for one sequence: "
        "capping max_model_len to %d (raise kv_cache_memory_bytes / --kv-cache-memory to serve "
        "longer sequences)", limit, kv_cache_tokens, kv_cache_tokens,
    )  # fmt: skip
    return replace(config, scheduler=replace(config.scheduler, max_model_len=kv_cache_tokens))


def _torch_dtype(name: str):  # noqa: ANN202 - torch imported lazily
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device_type: str
    dtype: str  # "torch.float32" etc.
    seed: int = 0
    served_model_name: str = "model"
    structured: StructuredConfig = StructuredConfig()
    compilation: CompilationConfig = CompilationConfig()
    cpu_kernels: bool = True  # EngineArgs.cpu_kernels
    attention_backend: str = "auto"  # EngineArgs.attention_backend
    lora: LoraConfig | None = None  # None: no adapters (EngineArgs.enable_lora)
    speculative: SpeculativeConfig | None = None  # None: off (EngineArgs.speculative_config)

    @property
    def torch_dtype(self):  # noqa: ANN201
        import torch

        return getattr(torch, self.dtype.replace("torch.", ""))

    @property
    def kv_torch_dtype(self):  # noqa: ANN201
        """The KV cache's element type (CacheConfig.kv_cache_dtype)."""
        import torch

        return torch.float8_e4m3fn if self.cache.kv_cache_dtype == "fp8" else self.torch_dtype

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's element type by name ("float8_e4m3fn", "bfloat16", ...): what the
        model card, logs and benchmarks show."""
        if self.cache.kv_cache_dtype == "fp8":
            return "float8_e4m3fn"
        return self.dtype.replace("torch.", "")
