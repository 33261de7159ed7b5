"""The engine section: what each replica's engine serves and how (workers/config.py's
EngineArgs). Fields marked `engine=True` are EngineArgs keywords of the same name, passed as
they are (ServeConfig.engine_kwargs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.config.checks import (
    is_int,
    is_num,
    need,
    need_bools,
    need_choice,
    need_positive_ints,
)
from cluster.config.setting import MODEL_GROUP, declared, setting
from workers.cache_config import KV_CACHE_DTYPES
from workers.compile_sizes import CPU_COMPILED_MIN_TOKENS
from workers.config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GRAMMAR_CACHE_SIZE,
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STEP_TIMEOUT_S,
)
from workers.quantization import QUANTIZATION_CHOICES
from workers.spec_decode.config import SpeculativeConfig

DEMO_MODEL_NAME = "kvray-demo"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineSettings:
    """The model and its engine, the same on every replica."""

    model: str | None = setting(
        None,
        "Hugging Face checkpoint directory or .gguf file (default: the built-in demo model)",
        MODEL_GROUP,
        kind="path",
    )
    served_model_name: str | None = setting(
        None, "model id clients send (default: the directory name)", MODEL_GROUP
    )
    tokenizer: str | None = setting(  # workers/tokenizer.py; a GGUF file embeds its own
        None,
        "Hugging Face tokenizer directory (default: the model's; a .gguf file's embedded one)",
        MODEL_GROUP,
        kind="path",
        engine=True,
    )
    tensor_parallel_size: int = setting(
        1, "GPUs (or CPU ranks) per engine replica", MODEL_GROUP, aliases=("--tp",), engine=True
    )
    max_model_len: int | None = setting(
        None, "context length (default: the checkpoint's)", MODEL_GROUP, engine=True
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV cache size per replica, e.g. 2GiB (default: the engine's choice)",
        MODEL_GROUP,
        name="--kv-cache-memory",
        kind="size",
        engine=True,
    )
    # workers/core/host_tier.py: evicted prefix-cache blocks kept in host memory.
    kv_offload_gib: float = setting(
        0.0,
        "GiB of host memory per replica keeping the KV blocks evicted from the prefix cache, "
        "copied back to the device instead of recomputed when a prompt shares them (0: off)",
        MODEL_GROUP,
        engine=True,
    )
    # cluster/replica/kv_share.py: KV blocks shared between replicas in Ray's object store.
    kv_share_gib: float = setting(
        0.0,
        "GiB of Ray's object store in which the replicas share the KV blocks they compute: "
        "a replica pulls a prompt's blocks from a peer instead of recomputing them when "
        "pulling is faster (0: off; needs --kv-offload-gib, where pulled blocks land)",
        MODEL_GROUP,
    )
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS, "sequences per engine step", MODEL_GROUP, engine=True
    )
    max_num_batched_tokens: int | None = setting(
        None, "token budget per engine step", MODEL_GROUP, engine=True
    )
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE,
        "tokens per KV-cache block; the router hashes whole blocks of a prompt",
        MODEL_GROUP,
        engine=True,
    )
    enable_prefix_caching: bool = setting(
        True, "disable the prefix cache", MODEL_GROUP, name="--no-prefix-caching", engine=True
    )
    # workers/device/compile.py; None leaves it to the engine (on only where measured to win).
    compile: bool | None = setting(
        None,
        "torch.compile the model forward (CUDA: decode batches replay CUDA graphs, other steps "
        f"run eagerly; CPU: steps of {CPU_COMPILED_MIN_TOKENS}+ tokens); default off: on CPU a "
        "few per cent more throughput, on a GPU faster decode steps but not yet a faster run, "
        "for seconds of start-up per engine",
        MODEL_GROUP,
        engine=True,
    )
    # workers/quantization.py: what config.json's quantization_config says, forced or refused.
    quantization: str = setting(
        "auto",
        "auto: what the checkpoint says (FP8 block-scaled; compressed-tensors FP8, W8A16, "
        "W4A16; GPTQ and AWQ int4; a GGUF file's tensor types); fp8: refuse a checkpoint "
        "that is not FP8; none: refuse a quantized checkpoint",
        MODEL_GROUP,
        choices=QUANTIZATION_CHOICES,
        engine=True,
    )
    # workers/device/layers/kv_quant.py: float8 e4m3 KV with the checkpoint's K/V scales.
    kv_cache_dtype: str = setting(
        "auto",
        "auto: the model's dtype; fp8: float8 e4m3 (a byte per value, the checkpoint's "
        "k_scale/v_scale else 1.0): twice the tokens of a bfloat16 cache in the same memory",
        MODEL_GROUP,
        choices=KV_CACHE_DTYPES,
        engine=True,
    )
    # workers/spec_decode/: n-gram drafts verified by the model in one step.
    speculative_config: str | None = setting(
        None,
        'speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (default: off)',
        MODEL_GROUP,
        engine=True,
    )
    # "auto" reaches the engine as None: it picks (cuda if visible).
    device: str = setting(
        "auto", "auto: cuda when the cluster has GPUs", MODEL_GROUP, choices=DEVICES
    )
    attention_backend: str = setting(  # workers/device/attention_backend.py
        "auto",
        "auto: torch (triton: opt-in on CUDA)",
        MODEL_GROUP,
        choices=ATTENTION_BACKENDS,
        engine=True,
    )
    # workers/core/engine.py: schedule step N+1 while step N runs (one rank only).
    async_scheduling: bool = setting(
        False,
        "schedule and launch each engine step before the last one's tokens reach the host, so "
        "the host's work overlaps the GPU's (tensor_parallel_size 1)",
        MODEL_GROUP,
        engine=True,
    )
    # Liveness: a replica whose engine has work and completes no step for this long fails its
    # requests and its health check, and Serve replaces it.
    step_timeout_s: float = setting(
        DEFAULT_STEP_TIMEOUT_S,
        "seconds an engine step may take before the replica counts as hung and is replaced",
        MODEL_GROUP,
        engine=True,
    )
    # Structured outputs: grammars compile off the engine's step loop, into a bounded cache.
    grammar_timeout_s: float = setting(
        DEFAULT_GRAMMAR_TIMEOUT_S,
        "seconds a structured-output constraint may take to compile; longer: HTTP 400 / "
        "INVALID_ARGUMENT naming structured_outputs",
        MODEL_GROUP,
        engine=True,
    )
    grammar_cache_size: int = setting(
        DEFAULT_GRAMMAR_CACHE_SIZE,
        "compiled constraints each engine keeps (LRU)",
        MODEL_GROUP,
        engine=True,
    )
    enable_expert_parallel: bool = setting(
        False,
        "mixture-of-experts models: give each tensor-parallel rank whole experts instead of a "
        "slice of every expert",
        MODEL_GROUP,
        engine=True,
    )

    def __post_init__(self) -> None:
        need_positive_ints(self, "tensor_parallel_size", "max_num_seqs", "block_size")
        need_positive_ints(self, "grammar_cache_size")
        for name in ("max_model_len", "kv_cache_memory_bytes", "max_num_batched_tokens"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= 1), name, "must be an integer >= 1 or null", v)
        for name in ("kv_offload_gib", "kv_share_gib"):
            v = getattr(self, name)
            need(is_num(v) and v >= 0, name, "must be a number >= 0", v)
        if is_num(self.kv_share_gib) and self.kv_share_gib > 0:
            need(
                self.kv_offload_gib > 0 and self.enable_prefix_caching is not False,
                "kv_share_gib",
                "needs kv_offload_gib > 0 (pulled blocks land in the host tier) and prefix caching",
                self.kv_share_gib,
            )
        for name in ("grammar_timeout_s", "step_timeout_s"):
            v = getattr(self, name)
            need(is_num(v) and v > 0, name, "must be a number > 0", v)
        need_bools(self, "enable_prefix_caching", "async_scheduling", "enable_expert_parallel")
        need(
            self.compile is None or isinstance(self.compile, bool),
            "compile",
            "must be a boolean",
            self.compile,
        )
        need(
            self.model is None or isinstance(self.model, str),
            "model",
            "must be a path string or null",
            self.model,
        )
        need(
            self.tokenizer is None or (isinstance(self.tokenizer, str) and self.tokenizer != ""),
            "tokenizer",
            "must be a path string or null",
            self.tokenizer,
        )
        need(
            self.served_model_name is None
            or (isinstance(self.served_model_name, str) and self.served_model_name != ""),
            "served_model_name",
            "must be a non-empty string or null",
            self.served_model_name,
        )
        need_choice(self, "device", DEVICES)
        need_choice(self, "attention_backend", ATTENTION_BACKENDS)
        need_choice(self, "quantization", QUANTIZATION_CHOICES)
        need_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key
        need(
            not self.async_scheduling or self.tensor_parallel_size == 1,
            "async_scheduling",
            "needs tensor_parallel_size 1 (only rank 0 samples)",
            self.async_scheduling,
        )

    def model_name(self) -> str:
        """The id clients put in `model`: served_model_name, else the dir's basename."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name or self.model
        return DEMO_MODEL_NAME

    def engine_args(self) -> dict[str, object]:
        """The EngineArgs keywords declared `engine=True`, as they are."""
        return {f.name: getattr(self, f.name) for f, s in declared(EngineSettings) if s.engine}
