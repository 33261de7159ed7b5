"""The runtime LoRA adapter registry's rules, on the class itself (the actor runs the same
code: tests/cluster/ingress/test_lora_live.py): ids never given twice, static adapters
unloaded and shadowed, ids kept above the static ones, versions."""

from __future__ import annotations

from cluster.ingress.lora_registry import STATIC_ID_BASE, Adapter, LoraRegistry, Statics, static_id

STATICS = Statics(("a", "b"))  # ids 1 and 2, from the config


def test_runtime_ids_start_above_the_static_ones_and_never_repeat() -> None:
    reg = LoraRegistry(restarted=False)
    c, snap = reg.load(STATICS, "c", "/x/c")
    assert c == Adapter("c", 3, "/x/c") and snap.runtime == (c,)
    d, _ = reg.load(STATICS, "d", "/x/d")
    assert d is not None and d.lora_int_id == 4
    found, snap = reg.unload(STATICS, "c")
    assert found and snap.runtime == (d,)
    # The same name from the same (maybe rewritten) path: a new id, never 3 again.
    again, _ = reg.load(STATICS, "c", "/x/c")
    assert again is not None and again.lora_int_id == 5


def test_a_static_id_is_its_name_and_path_above_every_runtime_id() -> None:
    assert static_id("a", "/x/a") == static_id("a", "/x/a")  # every ingress, every restart
    ids = {static_id(n, p) for n in ("a", "b") for p in ("/x/a", "/x/a/v2", "/y")}
    assert len(ids) == 6  # another name or path: another id
    assert all(STATIC_ID_BASE <= i < 2**63 for i in ids)  # a valid LoRARequest id
    restarted = LoraRegistry(restarted=True)  # the highest runtime ids: from the clock
    c, _ = restarted.load(STATICS, "c", "/x/c")
    assert c is not None and c.lora_int_id < STATIC_ID_BASE


def test_taken_names_and_unknown_unloads() -> None:
    reg = LoraRegistry(restarted=False)
    assert reg.load(STATICS, "a", "/x/other")[0] is None  # a static adapter's name
    reg.load(STATICS, "c", "/x/c")
    assert reg.load(STATICS, "c", "/x/c2")[0] is None
    found, snap = reg.unload(STATICS, "nope")
    assert not found and [x.name for x in snap.runtime] == ["c"]


def test_a_static_adapter_unloaded_then_loaded_again() -> None:
    reg = LoraRegistry(restarted=False)
    found, snap = reg.unload(STATICS, "a")
    assert found and snap.unloaded_static == {"a"}
    assert not reg.unload(STATICS, "a")[0]  # already gone
    a, snap = reg.load(STATICS, "a", "/x/a-v2")
    assert a is not None and a.lora_int_id == 3  # a new id: never the config's 1
    assert snap.unloaded_static == {"a"} and snap.runtime == (a,)


def test_more_static_adapters_move_runtime_ids_above_them() -> None:
    # A redeploy whose config has more static adapters than before: their ids 1..N would
    # reach runtime ids given earlier, so those runtime adapters get new ones.
    reg = LoraRegistry(restarted=False)
    c, _ = reg.load(Statics(), "c", "/x/c")
    assert c is not None and c.lora_int_id == 1
    snap = reg.snapshot(STATICS)
    assert snap is not None and snap.runtime == (Adapter("c", 3, "/x/c"),)
    d, _ = reg.load(STATICS, "d", "/x/d")
    assert d is not None and d.lora_int_id == 4
    # Back to fewer statics (an old ingress during the rollout): nothing moves.
    assert reg.snapshot(Statics()) is not None
    assert [x.lora_int_id for x in reg.snapshot(STATICS).runtime] == [3, 4]


def test_snapshot_is_none_while_nothing_changed() -> None:
    reg = LoraRegistry(restarted=False)
    snap = reg.snapshot(STATICS)
    assert snap is not None and snap.runtime == () and not snap.unloaded_static
    assert reg.snapshot(STATICS, snap.version) is None
    _, after = reg.load(STATICS, "c", "/x/c")
    assert after.version != snap.version
    assert reg.snapshot(STATICS, snap.version) == after


def test_a_restarted_registry_gives_ids_above_any_given_before() -> None:
    before = LoraRegistry(restarted=False)
    old, _ = before.load(STATICS, "c", "/x/c")
    restarted = LoraRegistry(restarted=True)  # its state (and counter) lost
    new, snap = restarted.load(STATICS, "c", "/x/c")
    assert old is not None and new is not None and new.lora_int_id > old.lora_int_id + 10**9
    assert new.lora_int_id < 2**63  # still a valid LoRARequest id
    assert snap.version[0] != before.snapshot(STATICS).version[0]  # caches see a new state
