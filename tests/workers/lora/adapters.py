"""Random LoRA adapters written by real peft, and peft's merged model as the oracle.

`write_random_adapter` wraps a tiny base checkpoint (tests/checkpoints.py) with peft and
saves an adapter whose factors are seeded random values: peft starts lora_B at zero (a no-op
adapter), which would prove nothing. `merged_hf_model` is the transformers model with an
adapter merged into its weights by peft, for `tests.checkpoints.hf_greedy`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from workers.lora.checkpoint import LORA_MODULES, WEIGHTS_FILE

# The std of each entry of a module's delta weight (scaling * B @ A): a fifth of the tiny
# checkpoints' weight std (0.15). Enough that most greedy tokens change (on llama and qwen3
# 86% and 94% of the argmaxes over a 35-token prompt differ from the base model's) while the base
# still dominates each projection; the logits' spread stays the base model's.
DEFAULT_DELTA_STD = 0.03


def write_random_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = LORA_MODULES,
    seed: int = 0,
    use_rslora: bool = False,
    strip_prefix: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
    scale: float = DEFAULT_DELTA_STD,
) -> Path:
    """Save a seeded random peft LoRA adapter for the checkpoint in `base_dir` to `out_dir`.

    scale: the std of each entry of every module's delta weight (scaling * B @ A), whatever
    its rank and alpha. dtype: the dtype the factors are saved in. strip_prefix: save the
    keys without peft's `base_model.model.` prefix (a form other tools write)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
    )
    with _quiet():
        model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(_lora_layers(model).items()):
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            r, scaling = a.shape[0], module.scaling["default"]
            # std(delta) = sqrt(r) * std(A) * std(B) * scaling, with std(A) = std(B).
            std = math.sqrt(scale / (math.sqrt(r) * scaling))
            a.copy_(torch.randn(a.shape, generator=gen) * std)
            b.copy_(torch.randn(b.shape, generator=gen) * std)
            if dtype != torch.float32:
                a.data = a.data.to(dtype)
                b.data = b.data.to(dtype)
    out_dir = Path(out_dir)
    with _quiet():
        model.save_pretrained(str(out_dir))
    if strip_prefix:
        _strip_prefix(out_dir / WEIGHTS_FILE)
    return out_dir


def _lora_layers(model: Any) -> dict[str, Any]:
    """peft's LoRA-wrapped modules of `model` by name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A")}


def _strip_prefix(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    renamed = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    save_file(renamed, str(file), metadata={"format": "pt"})


def merged_hf_model(base_dir: Path, adapter_dir: Path) -> Any:
    """The base checkpoint (float32, eval) with the adapter merged into its weights by peft.

    The adapter must be in peft's own key form (not written with strip_prefix)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    with _quiet():
        return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


@contextmanager
def _quiet() -> Iterator[None]:
    # peft 0.21 asks transformers 5 a deprecated question; nothing for the tests to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        yield
