"""A checkpoint's config.json read through transformers' own config class for its family.

The class fills absent keys with the family's defaults and reads every spelling transformers
has written: 4.x's `num_experts` (Qwen3-MoE) and `rope_theta` + `rope_scaling`, 5.x's
`num_local_experts` and `rope_parameters`, and so on. Its `to_dict()` is in the installed
version's spelling; the names its `attribute_map` aliases (e.g. `num_experts`) are added with
their values, so the readers (workers/config.py, moe_config.py, gemma_config.py,
rope_config.py) see one settled dict whichever version saved the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Each architecture's config class: by architecture rather than AutoConfig's model_type, as
# a text-only Gemma 3 checkpoint may carry the multimodal model_type "gemma3".
CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}


def settled_config(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (config.json's contents) as transformers' config class for `arch` reads it."""
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[arch])
    hf = cls.from_dict(raw)
    cfg = hf.to_dict()
    for alias in getattr(cls, "attribute_map", {}):
        cfg[alias] = getattr(hf, alias)
    return cfg


def read_config(path: Path, tokenizer: str | None = None) -> tuple[dict[str, Any], Path]:
    """(config.json's contents, the file they came from) of model `path`: a Hugging Face
    directory, or a GGUF file whose metadata gives them (workers/gguf/config.py), which must
    embed a tokenizer unless `tokenizer` (EngineArgs.tokenizer) names one."""
    from workers.gguf import is_gguf

    if is_gguf(path):
        from workers.gguf.config import gguf_config

        return gguf_config(path, needs_tokenizer=tokenizer is None), path
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return json.loads(cfg_file.read_text()), cfg_file


def eos_ids(path: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids: generation_config.json wins over config.json (that is what `generate` uses)."""
    value: Any = None
    gen = path / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
