"""Backend discovery through the ``kvstore_tiers.backends`` entry-point group.

Like fsspec's registry: a backend is a :class:`~kvstore_tiers.backends.base.Backend`
subclass named by an entry point, so a separately installed package adds a
tier type without any change to ours::

    [project.entry-points."kvstore_tiers.backends"]
    memory = "my_package.memory:MemoryBackend"

Our own fs, s3 and redis backends are registered the same way, in our
pyproject. Entry points are read lazily and a backend module is imported only
when a tier of that type is built, so a missing optional dependency (boto3,
redis) only matters to the users of that backend.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import TYPE_CHECKING

from kvstore_tiers.errors import ConfigError

if TYPE_CHECKING:
    from kvstore_tiers.backends.base import Backend
    from kvstore_tiers.tier import KVStoreTier

GROUP = "kvstore_tiers.backends"

_CLASS_NAMES = {"fs": "FileSystemTier", "s3": "S3Tier", "redis": "RedisTier"}

#: pip extra that provides the dependencies of each built-in backend.
_EXTRAS = {"s3": "s3", "redis": "redis"}


def backend_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Every installed backend, by name (first one wins on duplicates)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def backend_names() -> list[str]:
    return sorted(backend_entry_points())


def load_backend(name: str) -> type[Backend]:
    """Import the backend class registered as ``name``.

    Raises ConfigError for an unknown name (listing the installed ones) and
    for a backend whose optional dependencies are missing (naming the extra).
    """
    eps = backend_entry_points()
    if name not in eps:
        raise ConfigError(
            f"unknown tier type {name!r}: no kvstore_tiers backend of that name is installed "
            f"(installed: {', '.join(sorted(eps)) or 'none'})"
        )
    try:
        cls = eps[name].load()
    except ImportError as exc:
        extra = _EXTRAS.get(name)
        hint = f"; install it with: pip install 'kvstore-tiers[{extra}]'" if extra else ""
        raise ConfigError(f"tier type {name!r} cannot be loaded: {exc}{hint}") from exc
    from kvstore_tiers.backends.base import Backend

    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"entry point {name!r} of {GROUP} is not a Backend subclass: {cls!r}")
    return cls


@functools.cache
def tier_class(name: str) -> type[KVStoreTier]:
    """The vLLM SecondaryTierManager class for backend ``name`` (built once)."""
    from kvstore_tiers.tier import KVStoreTier

    backend = load_backend(name)
    cls_name = _CLASS_NAMES.get(name) or (
        f"{name.capitalize()}Tier" if name.isidentifier() else "PluginTier"
    )
    return type(
        cls_name,
        (KVStoreTier,),
        {"backend_cls": backend, "__module__": "kvstore_tiers.tiers",
         "__doc__": f"vLLM secondary tier over the {name!r} kvstore backend."},
    )
