"""Backend discovery, vLLM registration, the 'fs' takeover and the module_path route."""

from __future__ import annotations

import pytest

from kvstore_tiers.errors import ConfigError
from kvstore_tiers.registry import backend_names, load_backend


@pytest.fixture
def fresh_vllm_registry(monkeypatch: pytest.MonkeyPatch):
    """vLLM's tier registry as vLLM ships it (restored after the test)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    saved = dict(SecondaryTierFactory._registry)
    for name in list(SecondaryTierFactory._registry):
        if name in ("s3", "redis", "kvstore_fs", "vllm_fs") or name not in (
            "example", "fs", "p2p", "obj", "kvcr"
        ):
            del SecondaryTierFactory._registry[name]
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    SecondaryTierFactory._registry["fs"] = lambda: FileSystemTierManager
    yield SecondaryTierFactory
    SecondaryTierFactory._registry.clear()
    SecondaryTierFactory._registry.update(saved)


def test_builtin_backends_are_discovered_by_entry_point() -> None:
    assert {"fs", "s3", "redis"} <= set(backend_names())
    assert load_backend("fs").name == "fs"


def test_unknown_backend_lists_installed_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown tier type 'nope'.*installed: .*fs"):
        load_backend("nope")


def test_register_takes_over_fs_and_keeps_vllm_fs(fresh_vllm_registry) -> None:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from kvstore_tiers.plugin import register
    from kvstore_tiers.tier import KVStoreTier

    register()
    register()  # idempotent: a second call neither raises nor changes anything
    factory = fresh_vllm_registry
    ours = factory.get_tier_class({"type": "fs"})
    assert issubclass(ours, KVStoreTier) and ours.backend_cls.name == "fs"
    assert factory.get_tier_class({"type": "vllm_fs"}) is FileSystemTierManager
    assert factory.get_tier_class({"type": "s3"}).backend_cls.name == "s3"
    assert factory.get_tier_class({"type": "redis"}).backend_cls.name == "redis"


def test_opt_out_leaves_vllm_fs_alone(fresh_vllm_registry, monkeypatch) -> None:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from kvstore_tiers.plugin import register

    monkeypatch.setenv("KVSTORE_TIERS_KEEP_VLLM_FS", "1")
    register()
    factory = fresh_vllm_registry
    assert factory.get_tier_class({"type": "fs"}) is FileSystemTierManager
    assert factory.get_tier_class({"type": "kvstore_fs"}).backend_cls.name == "fs"


def test_load_general_plugins_registers_our_types_and_is_safe_twice(
    fresh_vllm_registry, monkeypatch
) -> None:
    import vllm.plugins as plugins

    monkeypatch.setattr(plugins, "plugins_loaded", False, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins.load_general_plugins()
    monkeypatch.setattr(plugins, "plugins_loaded", False, raising=False)
    plugins.load_general_plugins()
    registry = fresh_vllm_registry._registry
    assert {"s3", "redis", "vllm_fs", "kvstore_fs"} <= set(registry)
    for name in ("fs", "s3", "redis"):
        assert getattr(registry[name], "_kvstore_tiers", None) == name


def test_second_register_says_nothing_misleading(fresh_vllm_registry, caplog) -> None:
    """A second call must not claim vLLM owns the types our first call registered."""
    import logging

    from kvstore_tiers.plugin import register

    register()
    with caplog.at_level(logging.INFO, logger="kvstore_tiers"):
        register()
    assert not [r for r in caplog.records if "already has" in r.getMessage()]
    assert fresh_vllm_registry._registry["redis"]().backend_cls.name == "redis"


def test_module_path_route_without_registration(fresh_vllm_registry) -> None:
    from kvstore_tiers.tier import KVStoreTier

    factory = fresh_vllm_registry
    for type_name, backend in (("FileSystemTier", "fs"), ("s3", "s3"), ("redis", "redis")):
        cls = factory.get_tier_class({"type": type_name, "module_path": "kvstore_tiers.tiers"})
        assert issubclass(cls, KVStoreTier) and cls.backend_cls.name == backend


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch):
    """The registry's table, restored after the test."""
    from kvstore_tiers import registry

    monkeypatch.setattr(registry, "_implementations", dict(registry._implementations))
    registry.tier_class.cache_clear()
    yield registry
    registry.tier_class.cache_clear()


def test_register_backend_adds_a_type_by_class_or_path(scratch_registry) -> None:
    from kvstore_tiers.backends.fs import FileSystemBackend
    from kvstore_tiers.tier import KVStoreTier

    class LocalDisk(FileSystemBackend):
        name = "localdisk"

    scratch_registry.register_backend("localdisk", LocalDisk, tier_class_name="DiskTier")
    scratch_registry.register_backend("fs2", "kvstore_tiers.backends.fs:FileSystemBackend")
    assert {"localdisk", "fs2"} <= set(backend_names())
    assert load_backend("localdisk") is LocalDisk
    assert load_backend("fs2") is FileSystemBackend
    import kvstore_tiers.tiers as tiers

    cls = tiers.DiskTier
    assert issubclass(cls, KVStoreTier) and cls.backend_cls is LocalDisk
    assert tiers.localdisk is cls and "DiskTier" in dir(tiers)
    with pytest.raises(ValueError, match="already registered"):
        scratch_registry.register_backend("fs", LocalDisk)
    scratch_registry.register_backend("fs", LocalDisk, clobber=True)
    # The type keeps its names: the module_path route now builds the new class.
    assert tiers.FileSystemTier.backend_cls is LocalDisk and tiers.kvstore_fs is tiers.fs


def test_missing_dependency_names_the_install_hint(scratch_registry) -> None:
    scratch_registry.register_backend("ghost", "kvstore_tiers_no_such_module:Backend",
                                      install_hint="pip install kvstore-ghost")
    with pytest.raises(ConfigError, match=r"'ghost' cannot be loaded.*pip install kvstore-ghost"):
        load_backend("ghost")


def test_entry_points_feed_the_same_table(scratch_registry, tmp_path, monkeypatch) -> None:
    """An installed distribution's entry point is one more row of the table,
    beside the built-ins and their install hints; it never replaces a built-in."""
    dist = tmp_path / "kvstore_disk_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvstore-disk-plugin\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[kvstore_tiers.backends]\n"
        "disk = kvstore_tiers.backends.fs:FileSystemBackend\n"
        "s3 = kvstore_tiers.backends.fs:FileSystemBackend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(scratch_registry, "_entry_points_read", False)
    assert "disk" in backend_names()
    assert load_backend("disk").name == "fs"
    assert load_backend("s3").name == "s3"  # the built-in row stays
    assert scratch_registry._implementations["s3"].install_hint == \
        "pip install 'kvstore-tiers[s3]'"
