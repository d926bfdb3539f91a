"""Tier classes for vLLM's ``module_path`` route.

With our ``vllm.general_plugins`` entry point disabled (``VLLM_PLUGINS``), a
tier is still configured without registration::

    {"type": "s3", "module_path": "kvstore_tiers.tiers", ...}
    {"type": "FileSystemTier", "module_path": "kvstore_tiers.tiers", ...}

vLLM resolves ``getattr(kvstore_tiers.tiers, type)``. Every tier type of the
registry (``fs``, ``s3``, ``redis``, plugins) resolves here, as do their
class names and aliases (:mod:`kvstore_tiers.registry`). Note that ``"fs"``
itself is vLLM's built-in type name: vLLM's registry wins over
``module_path``, so with the plugin disabled use ``"FileSystemTier"`` (or
``"kvstore_fs"``) to get ours.
"""

from __future__ import annotations

from typing import Any

from kvstore_tiers.registry import backend_names, tier_attr_names, tier_class, tier_type_of


def __getattr__(name: str) -> Any:
    backend = tier_type_of(name)
    if backend is not None:
        return tier_class(backend)
    raise AttributeError(
        f"module 'kvstore_tiers.tiers' has no tier {name!r} (installed kvstore_tiers backends: "
        f"{', '.join(backend_names()) or 'none'}; is the package that provides it installed?)"
    )


def __dir__() -> list[str]:
    return tier_attr_names()
