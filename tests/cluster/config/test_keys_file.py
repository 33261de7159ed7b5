"""The API-keys file: what a good file gives, and every bad one a ValueError naming the file and
the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.config.keys_file import Quota, derived_name, key_digest, load_keys_file, parse_keys

GOOD = """
keys:
  - key: sk-acme-1
    name: acme
    requests_per_s: 5
    requests_burst: 10
  - key: sk-acme-2
    name: acme
    tokens_per_s: 2000
  - key: sk-anon
"""


def test_a_good_file_gives_tenants_and_their_quotas(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(GOOD)
    keys = load_keys_file(str(path))
    anon = derived_name("sk-anon")
    assert anon.startswith("key-") and len(anon) == 12 and "sk-anon" not in anon
    assert keys.tenants == ("acme", anon)
    # Quota fields of one tenant may sit on any of its keys.
    assert keys.quotas["acme"] == Quota(requests_per_s=5, tokens_per_s=2000, requests_burst=10)
    assert keys.quotas[anon] == Quota()
    assert keys.tenant_of_digest == {
        key_digest("sk-acme-1"): "acme",
        key_digest("sk-acme-2"): "acme",
        key_digest("sk-anon"): anon,
    }
    assert "sk-acme-1" not in repr(keys)  # only digests are kept


def test_json_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "k1", "name": "a", "tokens_per_s": 1.5}]}))
    assert load_keys_file(str(path)).quotas["a"].tokens_per_s == 1.5


def test_merged_takes_each_unset_rate_with_its_burst_from_the_fallback() -> None:
    own = Quota(requests_per_s=5)
    fallback = Quota(requests_per_s=1, tokens_per_s=100, requests_burst=3, tokens_burst=500)
    assert own.merged(fallback) == Quota(5, 100, None, 500)


BAD = [
    ("keys: [", "not valid YAML or JSON"),
    ("- key: a", "the document must be a mapping"),
    ("keys: []\nextra: 1", "extra is not a known field"),
    ("keys: []", "keys must be a non-empty list"),
    ("keys: [1]", "keys[0] must be a mapping"),
    ("keys:\n  - {key: a, tokens_per_sec: 3}", "keys[0].tokens_per_sec is not a known field"),
    ("keys:\n  - {name: x}", "keys[0].key must be a non-empty string"),
    ("keys:\n  - {key: 'a b'}", "keys[0].key must be a non-empty string"),
    ("keys:\n  - {key: 17}", "keys[0].key must be a non-empty string"),
    ("keys:\n  - {key: a}\n  - {key: a, name: b}", "keys[1].key repeats the key of keys[0]"),
    ("keys:\n  - {key: a, name: 'has space'}", "keys[0].name must be 1 to 64 characters"),
    ("keys:\n  - {key: a, name: other}", "keys[0].name 'other' is reserved"),
    ("keys:\n  - {key: a, requests_per_s: -1}", "keys[0].requests_per_s must be a number > 0"),
    ("keys:\n  - {key: a, tokens_per_s: 0}", "keys[0].tokens_per_s must be a number > 0"),
    ("keys:\n  - {key: a, tokens_per_s: fast}", "keys[0].tokens_per_s must be a number > 0"),
    ("keys:\n  - {key: a, tokens_per_s: true}", "keys[0].tokens_per_s must be a number > 0"),
    ("keys:\n  - {key: a, tokens_burst: .nan}", "keys[0].tokens_burst must be a number > 0"),
    ("keys:\n  - {key: a, tokens_burst: 5}", "keys[0].tokens_burst needs tokens_per_s"),
    (
        "keys:\n  - {key: a, name: t, requests_per_s: 1}\n  - {key: b, name: t, requests_per_s: 2}",
        "keys[1].requests_per_s is 2 but keys[0] gives tenant 't' 1",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_every_bad_file_names_the_file_and_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_keys(text, "/etc/kvray/keys.yaml")
    assert str(err.value).startswith("api_keys_file /etc/kvray/keys.yaml: "), err.value
    assert message in str(err.value)


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"api_keys_file .*nope\.yaml: cannot be read"):
        load_keys_file(str(tmp_path / "nope.yaml"))
