"""The kvray application's configuration: ServeConfig and its sections, each setting declared
once (cluster/config/setting.py), plus the parsing they need (API keys files, sizes)."""

from cluster.config.serve import ServeConfig, resolve_model_dir, resolve_tokenizer

__all__ = ["ServeConfig", "resolve_model_dir", "resolve_tokenizer"]
