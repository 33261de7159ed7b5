"""Tiny random Hugging Face checkpoints and transformers oracles for parity tests.

`make_checkpoint(kind, path)` writes a complete HF model directory (config.json, safetensors
weights, tokenizer files copied from the demo checkpoint) for one of four architecture
families, each picked to exercise a different loading/rope path in the engine:

- llama:   GQA, untied lm_head, llama3 rope scaling, OLD config spelling (rope_theta/rope_scaling)
- qwen2:   GQA, random q/k/v biases, default rope, NEW spelling (rope_parameters)
- qwen3:   q/k RMSNorm, head_dim != hidden/heads, tied embeddings, NEW spelling
- mistral: MQA, linear rope scaling (factor 2), OLD spelling with the legacy "type" key

By default config.json goes through the installed transformers' config class and
`save_pretrained` (the spelling users' checkpoints carry); the kind's spelling above is what
that class reads, and what `config_spelling` ("old" / "new") writes as it is.

Weights are raw tensors written with safetensors (no transformers model is instantiated), drawn
with a large std so greedy outputs vary, and every norm weight is random around 1 so a loader
that forgets one is caught. Everything is seeded: the same call writes the same bytes.

The oracles (`hf_greedy`, `hf_logprobs`) run transformers in float32 on CPU.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

KINDS = ("llama", "qwen2", "qwen3", "mistral")

Spelling = Literal["old", "new"]

# Tokenizer files copied verbatim from the source checkpoint when present. generation_config.json
# only holds special-token ids (bos/eos/pad), which belong to the tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

# Large on purpose: with the usual 0.02 the logits are near-uniform and greedy parity proves
# little (ties everywhere); 0.15 over hidden 128 gives logit std ~1.7.
_WEIGHT_STD = 0.15
_BIAS_STD = 0.1
_NORM_STD = 0.1


@dataclass(frozen=True)
class _Spec:
    """Shape and quirks of one checkpoint kind."""

    architecture: str
    model_type: str
    # rope in the NEW spelling (rope_parameters); the old spelling is derived from it.
    rope: dict[str, Any]
    default_spelling: Spelling
    num_kv_heads: int
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int | None = None  # None: hidden/heads and not written to config.json
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    # The legacy spelling some older checkpoints use inside rope_scaling ("type" vs "rope_type").
    old_type_key: str = "rope_type"
    extra_config: dict[str, Any] = field(default_factory=dict)


_SPECS: dict[str, _Spec] = {
    "llama": _Spec(
        architecture="LlamaForCausalLM",
        model_type="llama",
        # original_max_position_embeddings is small so the scaled frequencies differ from the
        # unscaled ones at the positions the tests reach (up to a few hundred).
        rope={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        default_spelling="old",
        num_kv_heads=2,
        rms_norm_eps=1e-5,
        extra_config={"attention_bias": False, "mlp_bias": False},
    ),
    "qwen2": _Spec(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        default_spelling="new",
        num_kv_heads=2,
        qkv_bias=True,
        extra_config={"use_sliding_window": False, "sliding_window": None},
    ),
    "qwen3": _Spec(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        default_spelling="new",
        num_kv_heads=2,
        head_dim=48,  # != 128 / 4: catches code that derives head_dim from hidden/heads
        qk_norm=True,
        tie_word_embeddings=True,
        extra_config={
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    "mistral": _Spec(
        architecture="MistralForCausalLM",
        model_type="mistral",
        rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        default_spelling="old",
        num_kv_heads=1,
        rms_norm_eps=1e-5,
        old_type_key="type",
        extra_config={"sliding_window": None},
    ),
}


def make_checkpoint(
    kind: str,
    path: Path,
    *,
    sharded: bool = False,
    config_spelling: Spelling | None = None,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random HF checkpoint of `kind` (one of KINDS) into `path` and return it.

    config_spelling: "old" (top-level rope_theta + rope_scaling) or "new" (rope_parameters),
    written as such; None: saved by the installed transformers (`write_config`). sharded:
    split the weights over two safetensors files plus model.safetensors.index.json.
    tokenizer_dir: where the tokenizer files come from (default: the built-in demo
    checkpoint). dtype: the stored dtype, float32 or bfloat16 (as most published checkpoints
    are).
    """
    if kind not in _SPECS:
        raise ValueError(f"kind must be one of {sorted(_SPECS)}, got {kind!r}")
    spec = _SPECS[kind]
    spelling = config_spelling or spec.default_spelling
    if spelling not in ("old", "new"):
        raise ValueError(f"config_spelling must be 'old' or 'new', got {spelling!r}")
    if tokenizer_dir is None:
        from workers.demo import demo_model_dir

        tokenizer_dir = demo_model_dir()

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _copy_tokenizer(Path(tokenizer_dir), path)
    config = {**_config(spec, spelling, vocab_size, special_ids), "torch_dtype": dtype}
    write_config(path, config, as_written=config_spelling is not None)
    # crc32 rather than hash(): hash() of str is randomised per process.
    tensors = _weights(spec, vocab_size, seed=seed * 1000003 + zlib.crc32(kind.encode()))
    import torch

    tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    _write_weights(tensors, path, sharded=sharded)
    return path


def write_config(path: Path, config: dict[str, Any], *, as_written: bool) -> None:
    """config.json: `config` as it is (`as_written`: a test of that spelling), or loaded into
    the installed transformers' config class for its architecture and saved by its
    `save_pretrained`, in the spelling checkpoints saved with that version carry."""
    if as_written:
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    import transformers

    from workers.hf_config import CONFIG_CLASSES

    cls = getattr(transformers, CONFIG_CLASSES[config["architectures"][0]])
    cls.from_dict(config).save_pretrained(str(path))


def _copy_tokenizer(src: Path, dst: Path) -> tuple[int, dict[str, int]]:
    """Copy the tokenizer files; return (vocab size incl. added tokens, {bos/eos/pad: id})."""
    from tokenizers import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok_config = _read_json(src / "tokenizer_config.json")
    special_ids: dict[str, int] = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = tok_config.get(key)
        if isinstance(token, dict):  # AddedToken serialised as {"content": ...}
            token = token.get("content")
        token_id = tok.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            special_ids[f"{key}_id"] = token_id
    return tok.get_vocab_size(with_added_tokens=True), special_ids


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _config(
    spec: _Spec, spelling: Spelling, vocab_size: int, special_ids: dict[str, int]
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        **special_ids,
        **spec.extra_config,
    }
    if spec.head_dim is not None:
        config["head_dim"] = spec.head_dim
    rope = dict(spec.rope)
    if spelling == "new":
        config["rope_parameters"] = rope
    else:
        # Old spelling: theta at the top level, scaling (if any) in rope_scaling, and null
        # rope_scaling for plain rope, as Llama-2/Mistral-era configs were saved.
        config["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.pop("rope_type")
        config["rope_scaling"] = None if rope_type == "default" else {spec.old_type_key: rope_type}
        if config["rope_scaling"] is not None:
            config["rope_scaling"].update(rope)
    return config


def _weights(spec: _Spec, vocab_size: int, *, seed: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = _WEIGHT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + normal(dim, std=_NORM_STD)

    hidden, inter = spec.hidden_size, spec.intermediate_size
    head_dim = spec.head_dim or hidden // spec.num_heads
    q_out, kv_out = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(hidden)
        t[f"{p}.self_attn.q_proj.weight"] = normal(q_out, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = normal(kv_out, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = normal(kv_out, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = normal(hidden, q_out)
        if spec.qkv_bias:
            t[f"{p}.self_attn.q_proj.bias"] = normal(q_out, std=_BIAS_STD)
            t[f"{p}.self_attn.k_proj.bias"] = normal(kv_out, std=_BIAS_STD)
            t[f"{p}.self_attn.v_proj.bias"] = normal(kv_out, std=_BIAS_STD)
        if spec.qk_norm:
            t[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            t[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        t[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        t[f"{p}.mlp.gate_proj.weight"] = normal(inter, hidden)
        t[f"{p}.mlp.up_proj.weight"] = normal(inter, hidden)
        t[f"{p}.mlp.down_proj.weight"] = normal(hidden, inter)
    t["model.norm.weight"] = norm(hidden)
    if not spec.tie_word_embeddings:
        t["lm_head.weight"] = normal(vocab_size, hidden)
    return t


def _write_weights(tensors: dict[str, torch.Tensor], path: Path, *, sharded: bool) -> None:
    from safetensors.torch import save_file

    metadata = {"format": "pt"}  # transformers warns without it
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
        return
    # Split by cumulative size so both files hold part of the layers (a layer's tensors may
    # straddle the boundary, as in real sharded checkpoints).
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total, half, acc = sum(sizes), sum(sizes) / 2, 0
    shards: list[list[str]] = [[], []]
    for name, size in zip(names, sizes, strict=True):
        shards[0 if acc + size / 2 < half else 1].append(name)
        acc += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# transformers oracles (float32, CPU)


def load_hf(path: Path) -> Any:
    """AutoModelForCausalLM in float32 on CPU, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _model(model_or_path: Any) -> Any:
    return load_hf(model_or_path) if isinstance(model_or_path, str | Path) else model_or_path


def hf_greedy(model_or_path: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids` from transformers, exactly `max_new_tokens` long.

    EOS neither stops nor is suppressed (kvray's ignore_eos): eos_token_id is set to an id
    the model can never produce (vocab_size) rather than using min_new_tokens, which would mask
    EOS logits and change the argmax wherever EOS is the top token.
    """
    import torch
    from transformers import GenerationConfig

    model = _model(model_or_path)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=model.config.get_text_config().vocab_size,  # out of range: never produced
        pad_token_id=0,
    )
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    new = out[0, len(prompt_ids) :].tolist()
    assert len(new) == max_new_tokens, f"transformers stopped early: {len(new)} tokens"
    return new


def hf_logprobs(model_or_path: Any, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Log-softmax rows of transformers for each of `output_ids` given everything before it.

    Returns a float32 tensor [len(output_ids), vocab]; row i is the distribution output_ids[i]
    was drawn from, so `rows[i, output_ids[i]]` is that token's logprob and `rows[i].topk(k)`
    the top-k alternatives. One teacher-forced forward pass (no KV cache involved).
    """
    import torch

    model = _model(model_or_path)
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(output_ids)], dim=-1)


def near_tie(logits_row: torch.Tensor, eps: float = 1e-4) -> bool:
    """True when the top two entries of a logits (or logprobs) row are within eps.

    Where this holds, float differences between implementations can legitimately flip the
    argmax, so parity tests should stop comparing at that position.
    """
    import torch

    top2 = torch.topk(logits_row.float(), 2).values
    return bool(top2[0] - top2[1] < eps)
