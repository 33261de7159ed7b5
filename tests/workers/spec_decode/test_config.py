"""--speculative-config read at the edge (workers/spec_decode/config.py)."""

from __future__ import annotations

import pytest

from workers.spec_decode.config import SpeculativeConfig


def test_vllms_shape_is_read_with_defaults() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c == SpeculativeConfig("ngram", 3, 2, 4, True)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    c = SpeculativeConfig.parse(
        {"num_speculative_tokens": 5, "prompt_lookup_max": 1, "adaptive": False}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == (1, 1, False)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported yet"),
        ('{"method": "lookahead", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5}', "exceeds prompt_lookup_max"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_max": 0}', "prompt_lookup_max"),
        ('{"num_speculative_tokens": 2, "draft": "x"}', "unknown key 'draft'"),
        ('{"num_speculative_tokens": 2, "adaptive": "yes"}', "adaptive"),
    ],
)
def test_a_wrong_value_is_refused_naming_it(value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_the_serve_setting_is_checked_before_anything_starts() -> None:
    from cluster.config.engine import EngineSettings

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineSettings(speculative_config='{"method": "ngram"}')
    ok = EngineSettings(speculative_config='{"num_speculative_tokens": 2}')
    assert ok.engine_args()["speculative_config"] == '{"num_speculative_tokens": 2}'


def test_a_draft_model_needs_its_checkpoint_and_only_it_takes_one() -> None:
    c = SpeculativeConfig.parse(
        {"method": "draft_model", "model": "/ckpt/small", "num_speculative_tokens": 3}
    )
    assert (c.method, c.model) == ("draft_model", "/ckpt/small")
    assert "draft /ckpt/small" in c.describe()
    with pytest.raises(ValueError, match="needs the draft checkpoint"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="model is for draft_model"):
        SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 3})
