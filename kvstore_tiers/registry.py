"""The backend registry: one table of implementations, fed three ways.

Modelled on fsspec's ``registry.py``. Every tier type is one row of one
table (:data:`_implementations`): where its :class:`~kvstore_tiers.backends.base.Backend`
class lives (``"module:Class"``, imported only when a tier of that type is
built, so a missing optional dependency only matters to its users), what to
install when that import fails, and the name of its vLLM tier class under
``kvstore_tiers.tiers`` (plus aliases). The rows come from:

* our built-in backends, listed below with their pip extras;
* :func:`register_backend`, the public way to add (or, with
  ``clobber=True``, replace) a backend at run time;
* the ``kvstore_tiers.backends`` entry-point group, read once, lazily, so a
  separately installed package adds a tier type without any change to ours::

      [project.entry-points."kvstore_tiers.backends"]
      memory = "my_package.memory:MemoryBackend"

A name already in the table keeps its row: built-ins and explicit
registrations win over entry points of the same name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore_tiers.errors import ConfigError

if TYPE_CHECKING:
    from kvstore_tiers.backends.base import Backend
    from kvstore_tiers.tier import KVStoreTier

GROUP = "kvstore_tiers.backends"


@dataclass(frozen=True)
class Implementation:
    """One tier type: its backend class (or ``"module:Class"``) and how to get it."""

    target: str | type[Backend]
    #: What to install when importing ``target`` fails (None: nothing to suggest).
    install_hint: str | None = None
    #: Class name under ``kvstore_tiers.tiers`` (None: ``<Name>Tier``).
    tier_class_name: str | None = None
    #: Further names under ``kvstore_tiers.tiers`` that mean this type.
    aliases: tuple[str, ...] = ()


def _extra(name: str) -> str:
    return f"pip install 'kvstore-tiers[{name}]'"


_implementations: dict[str, Implementation] = {
    "fs": Implementation("kvstore_tiers.backends.fs:FileSystemBackend",
                         tier_class_name="FileSystemTier", aliases=("kvstore_fs",)),
    "s3": Implementation("kvstore_tiers.backends.s3:S3Backend", _extra("s3"), "S3Tier"),
    "redis": Implementation("kvstore_tiers.backends.redis:RedisBackend", _extra("redis"),
                            "RedisTier"),
}
_entry_points_read = False


def register_backend(name: str, cls_or_path: str | type[Backend], *,
                     install_hint: str | None = None, tier_class_name: str | None = None,
                     clobber: bool = False) -> None:
    """Add tier type ``name``, served by a Backend class or its ``"module:Class"`` path.

    Raises ValueError if ``name`` is taken, unless ``clobber``; a replaced
    type keeps its tier class name and aliases unless given new ones.
    """
    _read_entry_points()
    old = _implementations.get(name)
    if old is not None and not clobber:
        raise ValueError(f"a kvstore_tiers backend named {name!r} is already registered "
                         f"({old.target!r}); pass clobber=True to replace it")
    _implementations[name] = Implementation(
        cls_or_path, install_hint, tier_class_name or (old and old.tier_class_name),
        old.aliases if old else (),
    )
    tier_class.cache_clear()


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for ep in importlib.metadata.entry_points(group=GROUP):
        _implementations.setdefault(ep.name, Implementation(ep.value.replace(" ", "")))


def backend_names() -> list[str]:
    """Every tier type in the table."""
    _read_entry_points()
    return sorted(_implementations)


def _import(target: str) -> object:
    module, _, attr = target.partition(":")
    if not attr:
        module, _, attr = target.rpartition(".")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_backend(name: str) -> type[Backend]:
    """The backend class of tier type ``name``.

    Raises ConfigError for an unknown name (listing the known ones) and for a
    backend whose optional dependencies are missing (with its install hint).
    """
    _read_entry_points()
    impl = _implementations.get(name)
    if impl is None:
        raise ConfigError(
            f"unknown tier type {name!r}: no kvstore_tiers backend of that name is installed "
            f"(installed: {', '.join(sorted(_implementations)) or 'none'})"
        )
    cls = impl.target
    if isinstance(cls, str):
        try:
            cls = _import(cls)
        except ImportError as exc:
            hint = f"; install it with: {impl.install_hint}" if impl.install_hint else ""
            raise ConfigError(f"tier type {name!r} cannot be loaded: {exc}{hint}") from exc
    from kvstore_tiers.backends.base import Backend

    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"kvstore_tiers backend {name!r} is not a Backend subclass: {cls!r}")
    return cls


def tier_type_of(attr: str) -> str | None:
    """The tier type that ``kvstore_tiers.tiers.<attr>`` means (a type, class name or alias)."""
    _read_entry_points()
    if attr in _implementations:
        return attr
    for name, impl in _implementations.items():
        if attr == impl.tier_class_name or attr in impl.aliases:
            return name
    return None


def tier_attr_names() -> list[str]:
    """Every name ``kvstore_tiers.tiers`` resolves."""
    _read_entry_points()
    names = set(_implementations)
    for impl in _implementations.values():
        names.update(impl.aliases)
        if impl.tier_class_name:
            names.add(impl.tier_class_name)
    return sorted(names)


@functools.cache
def tier_class(name: str) -> type[KVStoreTier]:
    """The vLLM SecondaryTierManager class for backend ``name`` (built once)."""
    from kvstore_tiers.tier import KVStoreTier

    backend = load_backend(name)
    cls_name = _implementations[name].tier_class_name or (
        f"{name.capitalize()}Tier" if name.isidentifier() else "PluginTier"
    )
    return type(
        cls_name,
        (KVStoreTier,),
        {"backend_cls": backend, "__module__": "kvstore_tiers.tiers",
         "__doc__": f"vLLM secondary tier over the {name!r} kvstore backend."},
    )
