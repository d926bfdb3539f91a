"""kvstore-memory: an in-process memory backend for kvstore-tiers.

This package is the reference for writing a third-party backend: one
:class:`~kvstore_tiers.backends.base.Backend` subclass, one config model
(a :class:`~kvstore_tiers.config.TierConfig` subclass) and one entry point
in the ``kvstore_tiers.backends`` group (see ``pyproject.toml``). The core
(``kvstore_tiers.tier.KVStoreTier``) does everything vLLM-facing: frames,
checksums, the I/O threads, existence checks, failed-key bookkeeping,
metrics. The backend only stores and returns bytes.

Objects live in a dict in the process that built the tier (vLLM's
scheduler process). They disappear with it, so this backend is for tests
and demos, not for sharing KV caches between engines.
"""

from __future__ import annotations

from kvstore_memory.backend import MemoryBackend, MemoryConfig

__all__ = ["MemoryBackend", "MemoryConfig"]
