"""The ``vllm.general_plugins`` entry point: register our tier types with vLLM.

vLLM calls :func:`register` with no arguments in every process it starts
(API server, engine core, workers), possibly several times, and does NOT
catch its exceptions (one would abort startup). So it is idempotent, cheap
(no backend module is imported) and never raises.

Every installed backend (``kvstore_tiers.backends`` entry points) is
registered with vLLM's ``SecondaryTierFactory`` under its name, unless vLLM
already has a tier of that name (then vLLM's wins and we log it).

``"fs"`` is the exception, by design: users asked for ``{"type": "fs"}`` to
mean our fs tier, which accepts every key of vLLM's stock fs tier. So by
default we replace vLLM's ``"fs"`` entry (logging one line that says so) and
keep vLLM's own tier reachable as ``"vllm_fs"``. Set
``KVSTORE_TIERS_KEEP_VLLM_FS=1`` to leave vLLM's ``"fs"`` alone (ours stays
available as ``"kvstore_fs"``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

KEEP_VLLM_FS_ENV = "KVSTORE_TIERS_KEEP_VLLM_FS"
TIERS_MODULE = "kvstore_tiers.tiers"


def _our_loader(name: str) -> Callable[[], Any]:
    def loader() -> Any:
        from kvstore_tiers.registry import tier_class

        return tier_class(name)

    loader._kvstore_tiers = name  # type: ignore[attr-defined]
    return loader


def register() -> None:
    """Register kvstore tier types with vLLM (idempotent, never raises)."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except Exception:  # a vLLM without tiering: nothing to do
        return
    try:
        from kvstore_tiers.log import attach_to_vllm_logging
        from kvstore_tiers.registry import backend_names

        attach_to_vllm_logging()

        registry = getattr(SecondaryTierFactory, "_registry", None)
        for name in backend_names():
            if name == "fs":
                continue
            if isinstance(registry, dict):
                if name not in registry:
                    # Our own loader (marked), so a second call knows it is ours.
                    registry[name] = _our_loader(name)
                elif not getattr(registry[name], "_kvstore_tiers", None):
                    logger.info("kvstore_tiers: vLLM already has a tier %r; keeping vLLM's", name)
                continue
            # ValueError: registered concurrently or by an earlier call.
            with contextlib.suppress(ValueError):
                SecondaryTierFactory.register_tier(name, TIERS_MODULE, name)
        _register_fs(SecondaryTierFactory, registry)
    except Exception:
        logger.exception("kvstore_tiers: registering tier types with vLLM failed")


def _register_fs(factory: Any, registry: Any) -> None:
    if not isinstance(registry, dict):
        logger.warning(
            "kvstore_tiers: vLLM's tier registry has an unexpected shape; leaving its 'fs' "
            "tier alone (use {'type': 'FileSystemTier', 'module_path': '%s'})", TIERS_MODULE,
        )
        return
    if "kvstore_fs" not in registry:
        registry["kvstore_fs"] = _our_loader("fs")
    current = registry.get("fs")
    if current is not None and getattr(current, "_kvstore_tiers", None):
        return  # already ours
    if os.environ.get(KEEP_VLLM_FS_ENV, "").strip().lower() in ("1", "true", "yes"):
        return
    if current is not None and "vllm_fs" not in registry:
        registry["vllm_fs"] = current
    registry["fs"] = _our_loader("fs")
    logger.info(
        "kvstore_tiers: tier type 'fs' now means kvstore_tiers' fs tier (checksummed frames, "
        "capacity control); vLLM's own is available as 'vllm_fs'. Set %s=1 to keep vLLM's.",
        KEEP_VLLM_FS_ENV,
    )
