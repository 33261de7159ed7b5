"""A setting's declaration: its flag spelling, and one declaration per key."""

from __future__ import annotations

from cluster.config import ServeConfig
from cluster.config.serve import SECTION_OF
from cluster.config.setting import GROUPS, MODEL_GROUP, Setting


def test_the_flag_is_the_key_with_dashes_unless_named() -> None:
    assert Setting("h", MODEL_GROUP).flag("max_num_seqs") == "--max-num-seqs"
    named = Setting("h", MODEL_GROUP, name="--kv-cache-memory")
    assert named.flag("kv_cache_memory_bytes") == "--kv-cache-memory"


def test_every_setting_is_declared_once_in_a_known_group() -> None:
    keys = [f.name for _, f, _ in ServeConfig.settings()]
    assert len(keys) == len(set(keys)) == len(SECTION_OF)
    assert all(s.group in GROUPS for _, _, s in ServeConfig.settings())
