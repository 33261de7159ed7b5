"""The built-in demo checkpoint: a tiny Qwen3 model that kvray and transformers both load.

`demo_model_dir()` builds it once into the user's cache and returns the directory. The build
needs no network and no transformers model: a byte-level BPE tokenizer is trained on the text
shipped in `workers/demo_corpus/`, and the weights are drawn from a seeded torch generator with
plain tensors. The weight scale is deliberately large (std 0.15 instead of the usual 0.02):
near-uniform logits would make greedy decoding emit one token forever and make
"same greedy tokens as transformers" a weak test, so the demo must have clear argmax margins
and varied continuations.

The cache directory name carries a hash of everything that determines the output (this
module's source, the recipe, the corpus text), so changing any of them builds a fresh copy
instead of reusing a stale one. Builds go into a temporary sibling directory that is renamed
into place, so concurrent processes (Ray workers starting together) never see a half-written
checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).with_name("demo_corpus")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML layout. Content may be a plain string or a list of OpenAI-style content parts, of
# which only the text parts are kept. With `tools`, a system turn lists them as JSON inside
# <tools></tools> and says how to call one: a JSON object {"name", "arguments"} inside
# <tool_call></tool_call> tags (the Hermes / Qwen convention, which kvray's tool-call parser
# reads). An assistant turn's `tool_calls` are written back in that form, and consecutive
# `tool` results go in one user turn, each inside <tool_response></tool_response>. With the
# template variable `enable_thinking` true (a request's chat_template_kwargs), the generation
# prompt opens a <think> block, as reasoning models' templates do, so that a reasoning parser
# reads the output as the model's thinking.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- text(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nThese functions are available, each described by a JSON object:\\n"
    "<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call functions, write one block per call, each a JSON object "
    "with the name and the arguments:\\n<tool_call>\\n"
    '{"name": <function name>, "arguments": <arguments object>}\\n</tool_call>'
    "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message.tool_calls is defined "
    "and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if not loop.first or text(message['content']) -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that fixes the demo checkpoint's bytes (together with the corpus)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The trainer stops early when the corpus runs out of pairs to merge, so the real
    # vocabulary can be a little smaller; the model's vocab_size follows the tokenizer.
    target_vocab_size: int = 4096
    seed: int = 0
    init_std: float = 0.15


def demo_model_dir(cache_dir: Path | None = None, recipe: DemoRecipe | None = None) -> Path:
    """Return the demo checkpoint directory, building it first if it is not cached yet.

    `cache_dir` is the parent directory (default `$XDG_CACHE_HOME/kvray` or `~/.cache/kvray`);
    the checkpoint lives in `demo-<hash>/` inside it.
    """
    recipe = recipe or DemoRecipe()
    root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
    target = root / f"demo-{recipe_hash(recipe)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        start = time.monotonic()
        logger.info("building the kvray demo checkpoint in %s", target)
        _build(tmp, recipe)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its finished copy first; both copies are identical.
            if not (target / "config.json").is_file():
                raise
        else:
            logger.info("built the demo checkpoint in %.1f s", time.monotonic() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def recipe_hash(recipe: DemoRecipe) -> str:
    """Short hash of all build inputs, used as the cache directory suffix."""
    h = hashlib.sha256()
    # This file's own source is the build code: any edit to it must invalidate old builds.
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    for path in _corpus_files():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvray"


def _corpus_files() -> list[Path]:
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"demo corpus missing: no *.txt files in {CORPUS_DIR}")
    return files


def _build(out: Path, recipe: DemoRecipe) -> None:
    vocab_size, special_ids = _build_tokenizer(out, recipe)
    bos_id, eos_id = special_ids[ENDOFTEXT], special_ids[IM_END]
    _write_json(out / "config.json", _model_config(recipe, vocab_size, bos_id, eos_id))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": bos_id},
    )
    _build_weights(out / "model.safetensors", recipe, vocab_size)


def _build_tokenizer(out: Path, recipe: DemoRecipe) -> tuple[int, dict[str, int]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.target_vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any UTF-8 text encodes even if the corpus never had it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [
        line for path in _corpus_files() for line in path.read_text(encoding="utf-8").splitlines()
    ]
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))

    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": ENDOFTEXT,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            # Makes all_special_ids (and so skip_special_tokens) cover the ChatML markers too.
            "additional_special_tokens": [IM_START, IM_END],
            # Like Qwen: nothing is prepended or appended when encoding a prompt.
            "add_bos_token": False,
            "add_eos_token": False,
            # Decoding must be a pure function of the bytes so incremental detokenization
            # can match a one-shot decode.
            "clean_up_tokenization_spaces": False,
            "model_max_length": recipe.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": ENDOFTEXT,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    return tok.get_vocab_size(with_added_tokens=True), special_ids


def _model_config(recipe: DemoRecipe, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    # Written by hand with the older top-level `rope_theta` key, which checkpoints in the wild
    # still use and every loader has to understand.
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_hidden_layers,
        "num_attention_heads": recipe.num_attention_heads,
        "num_key_value_heads": recipe.num_key_value_heads,
        "head_dim": recipe.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.max_position_embeddings,
        "rms_norm_eps": recipe.rms_norm_eps,
        "rope_theta": recipe.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": recipe.num_hidden_layers,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "initializer_range": recipe.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": bos_id,
    }


def _weight_shapes(recipe: DemoRecipe, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    h, d = recipe.hidden_size, recipe.head_dim
    q, kv = recipe.num_attention_heads * d, recipe.num_key_value_heads * d
    ff = recipe.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, h))]
    for i in range(recipe.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (ff, h)),
            (p + "mlp.up_proj.weight", (ff, h)),
            (p + "mlp.down_proj.weight", (h, ff)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def _build_weights(path: Path, recipe: DemoRecipe, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device="cpu").manual_seed(recipe.seed)
    tensors = {}
    # Drawn in a fixed order from one generator, so the bytes depend only on the recipe.
    for name, shape in _weight_shapes(recipe, vocab_size):
        if len(shape) == 1:  # every 1-D weight here is an RMSNorm scale
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * recipe.init_std
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
