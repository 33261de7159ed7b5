"""A thin wrapper over a Hugging Face fast tokenizer with the few calls the engine needs.

Conventions, chosen to match vLLM so prompts produce the same token ids there and here:

- `encode(text)` adds special tokens the way the tokenizer's own post-processor says
  (`add_special_tokens=True`): Llama-style tokenizers prepend BOS, Qwen-style ones (and the
  demo checkpoint) add nothing. Completion prompts go through this path.
- `apply_chat_template` renders the template to text and encodes it *without* special tokens,
  because the template already writes every marker (BOS included) it wants.
- `decode` never applies `clean_up_tokenization_spaces`: decoding must be a pure function of
  the token bytes, so the incremental detokenizer's deltas add up to exactly `decode(ids)`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """The engine's view of a checkpoint's tokenizer. Build with `Tokenizer.from_pretrained`."""

    def __init__(self, hf: Any, generation_eos: Sequence[int] = ()) -> None:
        self.hf = hf
        # The Rust tokenizer behind a fast tokenizer: transformers' own decode only adds
        # Python overhead on top of it (a few microseconds a call, and the detokenizer calls
        # decode for every generated token).
        self._backend = getattr(hf, "backend_tokenizer", None)
        eos = list(generation_eos)
        if hf.eos_token_id is not None:
            eos.append(hf.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.vocab_size: int = len(hf)

    @classmethod
    def from_pretrained(cls, path: str | Path, trust_remote_code: bool = False) -> Tokenizer:
        from transformers import AutoTokenizer

        from workers.gguf import is_gguf

        if is_gguf(path):  # the vocabulary, merges and chat template the file embeds
            from workers.gguf.tokenizer import gguf_tokenizer

            return cls(gguf_tokenizer(Path(path)))
        # transformers also picks up a chat_template.jinja stored beside tokenizer_config.json.
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return cls(hf, _generation_eos_ids(Path(path)))

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def render_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat as prompt text; extra keyword arguments are passed to the template."""
        if not self.has_chat_template:
            raise ValueError("the model has no chat template")
        return self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _generation_eos_ids(model_dir: Path) -> list[int]:
    """eos_token_id from generation_config.json (an int or a list), if the file has one."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
