"""One block round-tripped through vLLM's real manager (``kvstore-tiers check``).

The check writes into the user's real store (that is what it checks: the
endpoint, the credentials, the permissions, the disk), so it works in a
namespace of its own, salted with a random id, and removes that namespace
afterwards: its objects, its run config, and on a local store its
directories. No engine ever uses the check's namespace, so removing it
cannot touch a block an engine stored.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore_tiers.admin.config import backend_type, validate_tier
from kvstore_tiers.admin.store import open_store
from kvstore_tiers.backends.base import Backend
from kvstore_tiers.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class CheckReport:
    """Outcome of :func:`check_tier` for one tier."""

    tier_type: str
    ok: bool
    backend: str = ""
    namespace: str = ""
    codec: str = ""
    o_direct: bool | None = None
    store_ms: float = 0.0
    load_ms: float = 0.0
    block_bytes: int = 0
    stored_bytes: int = 0
    #: Read back by a second engine (a restart); False where the backend's objects
    #: do not outlive their engine (``Backend.persistent``), so the storing engine
    #: reads the block back after dropping it from its primary.
    restarted: bool = True
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def remove_namespace(backend: Backend, namespace: str) -> None:
    """Delete every object of ``namespace``, its run config and, on a local
    store (a backend with a ``root`` directory), its directory tree.

    Only for a namespace nobody else uses (the check's own): an engine's
    namespace is never removed, only its objects are collected (gc).
    """
    backend.delete_many([o.name for o in backend.iter_objects(f"{namespace}/")])
    backend.delete(f"{namespace}/config.json")
    root = getattr(backend, "root", None)
    if isinstance(root, Path) and namespace and "/" not in namespace:
        shutil.rmtree(root / namespace, ignore_errors=True)


def check_tier(tier: Mapping[str, Any], *, block_bytes: int = 256 << 10,
               timeout_s: float = 30.0) -> CheckReport:
    """Validate, connect and round-trip one block through vLLM's real manager.

    The tier is built by vLLM's ``SecondaryTierFactory`` inside a real
    ``TieringOffloadingManager`` (:func:`kvstore_tiers.admin.harness.build_harness`),
    so this checks what ``vllm serve`` would build. One random block is
    stored by a first manager, which is shut down; a second manager (a
    restarted engine) looks it up, which asks the backend, and loads it; the
    bytes are compared. A backend whose objects go with their engine
    (``persistent = False``, an in-process store) cannot be read by a
    restart: there the first manager drops the block from its primary and
    loads it back from the tier itself (``report.restarted`` is False). Both
    run in a namespace of the check's own, removed at the end (see the module
    docstring). Never raises for a tier problem: the report carries the error
    message.
    """
    import numpy as np

    from kvstore_tiers.admin.harness import build_harness, make_keys

    kind = backend_type(tier) if "type" in tier else "?"
    rep = CheckReport(tier_type=kind, ok=False, block_bytes=block_bytes)
    try:
        backend_cls, _ = validate_tier(tier)
    except ConfigError as exc:
        rep.error = str(exc)
        return rep
    rep.restarted = backend_cls.persistent
    salt = f"{tier.get('namespace_salt') or ''}|kvstore-check-{uuid.uuid4().hex}"
    scratch = {**tier, "namespace_salt": salt}
    if "model_version" not in tier:
        # The check's engine serves no model (its name is a placeholder with no
        # files): no fingerprint to take, and no warning that it cannot be taken.
        scratch["model_fingerprint"] = "off"
    key = make_keys(1, seed=int(time.time_ns() % (1 << 31)))
    rows = np.random.default_rng().integers(0, 256, (1, block_bytes), dtype=np.uint8)
    try:
        rep.error = _round_trip(build_harness, scratch, key, rows, rep, timeout_s)
        rep.ok = not rep.error
    except ImportError:
        raise  # a missing optional package is the installation's problem, not the tier's
    except Exception as exc:  # ConfigError from the tier, or vLLM refusing the config
        rep.error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    finally:
        if rep.namespace:  # set once the first engine built the tier
            try:
                with open_store(tier) as backend:
                    remove_namespace(backend, rep.namespace)
            except Exception as exc:  # the round trip's verdict stands; say what is left
                logger.warning("check: could not remove its namespace %s: %s", rep.namespace,
                               exc)
    return rep


def _round_trip(build: Any, tier: dict[str, Any], key: list[bytes], rows: Any,
                rep: CheckReport, timeout_s: float) -> str:
    """Store with a first engine, shut it down, load with a second one (a restart);
    where the objects go with their engine, the first loads the block back after
    forgetting its primary. '' or an error."""
    first = build([tier], num_chunks=4, chunk_bytes=rows.shape[1])
    try:
        error = _store(first, key, rows, rep, timeout_s)
        if not error and not rep.restarted:
            first.forget_primary()
            error = _load(first, key, rows, rep, timeout_s)
    finally:
        first.shutdown()
    if error or not rep.restarted:
        return error
    second = build([tier], num_chunks=4, chunk_bytes=rows.shape[1])
    try:
        return _load(second, key, rows, rep, timeout_s)
    finally:
        with contextlib.suppress(Exception):
            second.shutdown()


def _store(h: Any, key: list[bytes], rows: Any, rep: CheckReport, timeout_s: float) -> str:
    """Store the block through ``h``, fill the report's static fields; '' or an error."""
    t = h.tiers[0]
    rep.backend = t.backend.describe()
    rep.namespace = t.namespace.name
    rep.codec = t.codec_id.name.lower()
    rep.o_direct = getattr(t.backend, "use_o_direct", None)
    t0 = time.perf_counter()
    ctx = h.store(key, rows)
    h.settle(timeout_s)
    rep.store_ms = (time.perf_counter() - t0) * 1e3
    h.finish_request(ctx)
    c = t.counters
    if c.objects_stored + c.objects_skipped < 1:
        return f"store failed ({c.store_failures} failures, {c.stores_dropped} dropped)"
    rep.stored_bytes = c.stored_bytes_written
    return ""


def _load(h: Any, key: list[bytes], rows: Any, rep: CheckReport, timeout_s: float) -> str:
    """Look the block up through ``h`` (asking the tier) and load it; '' or an error."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult

    ctx = h.new_request()
    t0 = time.perf_counter()
    results, _steps = h.lookup_until_resolved(key, ctx, timeout_s=timeout_s)
    if results[0] is not LookupResult.HIT:
        return f"block stored but the lookup answered {results[0].name}"
    back = h.load(key, ctx)
    rep.load_ms = (time.perf_counter() - t0) * 1e3
    h.finish_request(ctx)
    if not np.array_equal(back[0], rows[0]):
        return "block read back differs from the block written"
    return ""
