"""KV offloading on vLLM's CPU platform (the ``kvstore_cpu_platform`` vLLM plugin).

vLLM's CPU build refuses the OffloadingConnector on the worker side:
``CPUOffloadingSpec.get_worker`` raises on platforms other than CUDA-alike/XPU,
and the stock ``CPUOffloadingWorker`` is CUDA-only. On the CPU platform the
"GPU" KV cache is host memory, so :class:`CPUMemmoveOffloadingWorker` (a
synchronous memmove copy worker) does the job. :func:`register` installs it.

What :func:`register` patches, and only on the CPU platform:

* ``CPUOffloadingSpec.get_worker`` -> build the worker through the spec's own
  ``create_worker`` (so ``TieringOffloadingSpec`` still creates its shared
  offload region, and cleans it up if construction fails), skipping the
  platform check.
* the name ``CPUOffloadingWorker`` inside ``vllm.v1.kv_offload.cpu.spec`` and
  ``vllm.v1.kv_offload.tiering.spec`` (the name ``create_worker`` resolves)
  -> :class:`CPUMemmoveOffloadingWorker`. ``vllm.v1.kv_offload.cpu.gpu_worker``
  itself is not touched.

Contract of :func:`register` (it is a ``vllm.general_plugins`` entry point,
called with no arguments in every vLLM process, possibly several times):
idempotent, cheap when not on CPU, never raises (a raising plugin aborts vLLM
startup), logs exactly one INFO line per process when it activates, and does
nothing (with a WARNING) if vLLM's classes do not look as expected.

Idempotent across copies too: the patch is marked on vLLM's class by
:data:`PATCH_MARKER`, a name shared with every other copy of this patch
(kvstore-tiers 0.1.0 shipped it as ``kvstore_tiers.cpu_offload`` with the entry
point ``kvstore_tiers_cpu``), so whichever registers first patches and the
others find the marker and do nothing.

It is a package and an entry point of its own, apart from kvstore-tiers (tier
registration, entry point ``kvstore_tiers``): ``VLLM_PLUGINS`` must list
``kvstore_cpu_platform`` on a CPU machine for the OffloadingConnector to work,
and ``VLLM_PLUGINS=kvstore_cpu_platform`` keeps CPU offloading while
disabling tier registration.

Refused (clear error at engine start, not silently wrong): ``canonical_layout``
(raised by the worker) and an offload ``block_size`` that is not a multiple of
the KV cache block size (vLLM's CPU default is 128 tokens; vLLM's own config
check raises for that).
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

__all__ = ["PATCH_MARKER", "is_active", "register"]

# See worker.py: a child of vLLM's logger so the line is visible by default.
logger = logging.getLogger("vllm.kvstore_cpu_platform")

#: Attribute set on the patched ``CPUOffloadingSpec`` (value: the original
#: ``get_worker``); presence means "already patched in this process", by this
#: module or another copy of the patch. Its value must never change.
PATCH_MARKER = "_kvstore_tiers_cpu_original_get_worker"

_SPEC_MODULES = ("vllm.v1.kv_offload.cpu.spec", "vllm.v1.kv_offload.tiering.spec")
_lock = threading.Lock()


def register() -> None:
    """Entry point ``kvstore_cpu_platform``: enable KV offloading on vLLM's CPU platform.

    Never raises; see the module docstring for the full contract."""
    try:
        with _lock:
            _register()
    except Exception:  # a raising general plugin would abort vLLM's startup
        logger.warning(
            "kvstore_cpu_platform: could not enable KV offloading on CPU; leaving vLLM unchanged",
            exc_info=True,
        )


def is_active() -> bool:
    """Whether the CPU offloading patch is installed in this process."""
    try:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    except Exception:
        return False
    return PATCH_MARKER in vars(CPUOffloadingSpec)


def _register() -> None:
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM not installed/importable: nothing to do
        return
    if not current_platform.is_cpu():
        # CUDA/ROCm/XPU/...: vLLM's own worker applies; never touch that path.
        return
    import importlib

    modules: list[ModuleType] = []
    for name in _SPEC_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            # A vLLM without tiering still gets plain CPU offloading.
            logger.debug("kvstore_cpu_platform: %s not available", name)
    if not modules or modules[0].__name__ != _SPEC_MODULES[0]:
        logger.warning(
            "kvstore_cpu_platform: vllm.v1.kv_offload.cpu.spec not importable; "
            "KV offloading on CPU stays disabled"
        )
        return
    from kvstore_cpu_platform.worker import CPUMemmoveOffloadingWorker

    if apply_patch(modules, CPUMemmoveOffloadingWorker):
        logger.info(
            "kvstore_cpu_platform: KV offloading enabled on vLLM's CPU platform "
            "(OffloadingConnector uses a synchronous memmove copy worker; "
            "canonical_layout unsupported)"
        )


def apply_patch(modules: list[ModuleType], worker_cls: type) -> bool:
    """Patch ``CPUOffloadingSpec`` found in ``modules[0]`` to build ``worker_cls``.

    ``modules`` are the spec modules whose global ``CPUOffloadingWorker`` name
    ``create_worker`` resolves; ``modules[0]`` must define ``CPUOffloadingSpec``.
    Returns True if this call installed the patch, False if it was already
    installed or vLLM does not look as expected (then nothing is changed).
    Split out of :func:`register` so tests can run it on stand-in modules.
    """
    spec_cls: Any = getattr(modules[0], "CPUOffloadingSpec", None)
    if spec_cls is None:
        logger.warning("kvstore_cpu_platform: CPUOffloadingSpec not found; not patching")
        return False
    if PATCH_MARKER in vars(spec_cls):
        return False  # idempotent: already patched in this process
    original_get_worker = vars(spec_cls).get("get_worker")
    if not callable(original_get_worker) or not callable(getattr(spec_cls, "create_worker", None)):
        logger.warning(
            "kvstore_cpu_platform: CPUOffloadingSpec has no get_worker/create_worker; "
            "this vLLM is not supported, not patching"
        )
        return False
    targets = [m for m in modules if hasattr(m, "CPUOffloadingWorker")]
    if modules[0] not in targets:
        logger.warning(
            "kvstore_cpu_platform: %s does not use CPUOffloadingWorker; not patching",
            modules[0].__name__,
        )
        return False
    for m in modules:
        sub = getattr(m, "TieringOffloadingSpec", None)
        if sub is not None and "get_worker" in vars(sub):
            # A future vLLM overriding get_worker there would bypass our patch
            # silently; say so instead of half-working.
            logger.warning(
                "kvstore_cpu_platform: %s.TieringOffloadingSpec overrides get_worker; "
                "tiering offload on CPU may not work with this vLLM",
                m.__name__,
            )

    def get_worker(self: Any, kv_caches: Any) -> Any:
        """CPU platform: build the worker via ``create_worker`` (no CUDA check)."""
        if getattr(self, "_worker", None) is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    get_worker.__qualname__ = f"{spec_cls.__qualname__}.get_worker"
    for m in targets:
        m.CPUOffloadingWorker = worker_cls  # type: ignore[attr-defined]
    spec_cls.get_worker = get_worker
    setattr(spec_cls, PATCH_MARKER, original_get_worker)
    return True
