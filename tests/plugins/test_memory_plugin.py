"""A third-party backend package, found through our entry points, in vLLM's real manager.

The plugin (plugins/kvstore-memory) is installed into a temp dir and used
only by child processes, so the shared venv and this pytest process never
see it: with it, ``{"type": "memory"}`` is a working tier with no change to
kvstore_tiers; without it, the same config fails with an error that names
the type and the types that do exist.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from types import ModuleType

import pytest

from .plugin_helpers import load_backend_module, run_child

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def memory_mod() -> ModuleType:
    return load_backend_module()


def _backend(mod: ModuleType, max_bytes: int):
    return mod.MemoryBackend(mod.MemoryConfig(max_bytes=max_bytes), namespace=None)


# -- the backend on its own ------------------------------------------------------------

def test_config_is_a_tierconfig_with_a_validated_budget(memory_mod: ModuleType) -> None:
    from kvstore_tiers.config import TierConfig, validate_config
    from kvstore_tiers.errors import ConfigError

    assert issubclass(memory_mod.MemoryConfig, TierConfig)
    assert memory_mod.MemoryBackend.config_model is memory_mod.MemoryConfig
    cfg = validate_config(memory_mod.MemoryConfig, "memory", {"max_bytes": 1024})
    assert cfg.max_bytes == 1024 and cfg.compression == "auto"  # common keys inherited
    with pytest.raises(ConfigError, match=r"key 'max_bytes'"):
        validate_config(memory_mod.MemoryConfig, "memory", {"max_bytes": 0})
    with pytest.raises(ConfigError, match=r"key 'root_dir': unknown key .*max_bytes"):
        validate_config(memory_mod.MemoryConfig, "memory", {"root_dir": "/tmp"})


def test_put_get_exists_delete_contract(memory_mod: ModuleType) -> None:
    from kvstore_tiers.errors import ObjectMissing

    b = _backend(memory_mod, 1 << 10)
    src = bytearray(b"world")
    assert b.put("a", [b"hello ", memoryview(src)]) is True
    src[:] = b"XXXXX"  # the caller reuses its buffer: the stored copy must not change
    assert b.put("a", [b"other"]) is False  # content-addressed: existing left alone
    assert bytes(b.get("a")) == b"hello world"
    assert b.exists_many(["a", "b"]) == [True, False]
    with pytest.raises(ObjectMissing):
        b.get("b")
    assert [(o.name, o.size) for o in b.iter_objects()] == [("a", 11)]
    b.delete("a")
    b.delete("a")  # missing is not an error
    assert b.exists_many(["a"]) == [False] and b.used_bytes == 0


def test_evicted_objects_report_their_keys(memory_mod: ModuleType) -> None:
    from types import SimpleNamespace

    from kvstore_tiers.admin.harness import make_keys
    from kvstore_tiers.namespace import Namespace

    b = _backend(memory_mod, 300)
    keys = make_keys(4, seed=3)
    for k in keys:  # the fourth evicts the first
        b.put(Namespace.object_name(SimpleNamespace(name="ns"), k), [bytes(100)])  # type: ignore[arg-type]
    assert b.evictions.objects == b.evictions.for_capacity == 1
    assert list(b.evictions.keys) == [keys[0]]  # for the tier's presence index


def test_lru_eviction_keeps_the_budget(memory_mod: ModuleType) -> None:
    from kvstore_tiers.errors import TransientError

    b = _backend(memory_mod, 300)
    for name in "abc":
        b.put(name, [bytes(100)])
    b.get("a")            # a is now the most recently used
    b.touch_many(["b"])   # then b
    b.put("d", [bytes(100)])  # evicts c, the least recently used
    assert b.exists_many(list("abcd")) == [True, True, False, True]
    assert b.used_bytes == 300 and b.evictions.objects == 1
    b.put("e", [bytes(250)])  # needs room for 250: evicts a, b and d
    assert b.exists_many(list("abde")) == [False, False, False, True]
    assert b.used_bytes == 250
    with pytest.raises(TransientError, match="exceeds max_bytes"):
        b.put("huge", [bytes(301)])
    assert b.exists_many(["e"]) == [True], "an object that cannot fit must not flush the rest"


def test_thread_safe_under_concurrent_writers_and_readers(memory_mod: ModuleType) -> None:
    from kvstore_tiers.errors import ObjectMissing

    b = _backend(memory_mod, 64 * 1000)  # room for 64 of the 1000-byte objects

    def work(t: int) -> int:
        ok = 0
        for i in range(400):
            name = f"k{(t * 7 + i) % 200}"
            payload = bytes([i % 256]) * 1000
            b.put(name, [payload])
            try:
                frame = b.get(name)
                assert len(frame) == 1000 and len(set(frame)) == 1  # never torn
                ok += 1
            except ObjectMissing:
                pass  # evicted by another thread in between: allowed
            b.exists_many([name, "nope"])
        return ok

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert sum(ex.map(work, range(8))) > 0
    assert b.used_bytes <= 64 * 1000
    assert b.used_bytes == sum(o.size for o in b.iter_objects())


# -- installed as a package, in vLLM's real tiering manager ------------------------------

def test_plugin_tier_round_trip_in_vllm_manager(plugin_site: Path) -> None:
    r = run_child("roundtrip", plugin_site)
    assert r["installed"] == ["fs", "memory", "redis", "s3"]
    # vLLM's factory resolved {"type": "memory"} to our generic adapter over the plugin
    assert r["tier_class"] == "kvstore_tiers.tiers.MemoryTier"
    assert r["backend"] == "kvstore_memory.backend.MemoryBackend"
    assert r["config_model"] == "MemoryConfig"
    assert r["locality"] == "LOCAL"
    assert r["objects_stored"] == 8 and 8 * 4096 < r["used_bytes"] < 9 * 4096
    assert r["all_hit"], r["lookups"]
    assert r["byte_exact"], "promoted rows differ from the stored ones"


def test_check_round_trips_a_memory_tier_in_one_engine(plugin_site: Path) -> None:
    """A memory tier's objects go with its engine, so check's restart could never
    find them: the storing engine reads the block back, and the output says so."""
    r = run_child("check", plugin_site)
    rep = r["report"]
    assert r["json_exit"] == 0 and rep["ok"], rep["error"]
    assert rep["restarted"] is False
    assert rep["backend"].startswith("memory (in-process")
    assert rep["stored_bytes"] > rep["block_bytes"]  # a frame: header + the block
    assert r["text_exit"] == 0
    assert "read back by" in r["text"] and "do not outlive it" in r["text"]


def test_without_plugin_the_same_config_fails_clearly() -> None:
    r = run_child("unknown", None)
    # Registered-name route: our vllm.general_plugins entry point registers
    # every installed backend; "memory" is not one, so vLLM's factory refuses
    # it and lists the types it knows (ours included).
    reg = r["registered_name"]
    assert reg["error"] == "ValueError"
    assert "Unknown secondary tier type: 'memory'" in reg["message"]
    for name in ("'fs'", "'s3'", "'redis'"):
        assert name in reg["message"]
    # module_path route: vLLM asks kvstore_tiers.tiers for the attribute.
    mp = r["module_path"]
    assert mp["error"] == "AttributeError"
    assert "'memory'" in mp["message"] and "kvstore_tiers.tiers" in mp["message"]
    assert "installed kvstore_tiers backends: fs, redis, s3" in mp["message"]
