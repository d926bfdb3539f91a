"""Garbage collection by age and size, one planner for every backend (``kvstore-tiers gc``).

The objects come from ``iter_objects`` and go through ``delete_many`` in
batches of :data:`DELETE_BATCH`: a backend with a native batch delete (s3
DeleteObjects, a redis UNLINK pipeline) declares ``supports_delete_many``
and gc uses it without knowing which backend it is; any other backend gets
the default loop over ``delete``.

Ages are each backend's object mtime (fs: mtime, the last use when capped;
s3: LastModified, the write, so gc there is FIFO; redis: the frame's
created_ms, 0 for a value that is not a frame, so it goes first). Sizes are
as the backend lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore_tiers.admin.store import listed, open_store
from kvstore_tiers.backends.base import Backend, ObjectInfo
from kvstore_tiers.errors import ConfigError

#: Names per ``delete_many`` call: S3 DeleteObjects takes at most 1,000 keys.
DELETE_BATCH = 1000


@dataclass(frozen=True)
class GcResult:
    """What :func:`gc` did (or, with ``dry_run``, would do)."""

    scanned_objects: int
    scanned_bytes: int
    deleted_objects: int
    deleted_bytes: int
    #: The backend deleted in native batches (``supports_delete_many``).
    batched: bool
    dry_run: bool = False

    @property
    def remaining_bytes(self) -> int:
        return self.scanned_bytes - self.deleted_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "scanned_objects": self.scanned_objects,
                "scanned_bytes": self.scanned_bytes, "deleted_objects": self.deleted_objects,
                "deleted_bytes": self.deleted_bytes, "remaining_bytes": self.remaining_bytes,
                "batched_deletes": self.batched}


def plan_gc(objs: Sequence[ObjectInfo], *, max_age_s: float | None, max_bytes: int | None,
            now: float) -> list[ObjectInfo]:
    """The objects to delete: older than ``max_age_s``, then the oldest of the
    rest until at most ``max_bytes`` remain."""
    doomed: list[ObjectInfo] = []
    keep: list[ObjectInfo] = []
    for o in objs:
        (doomed if max_age_s is not None and now - o.mtime > max_age_s else keep).append(o)
    if max_bytes is not None:
        keep.sort(key=lambda o: o.mtime)
        remaining = sum(o.size for o in keep)
        for o in keep:
            if remaining <= max_bytes:
                break
            doomed.append(o)
            remaining -= o.size
    return doomed


def gc_store(backend: Backend, *, max_age_s: float | None = None,
             max_bytes: int | None = None, namespace: str | None = None,
             dry_run: bool = False, now: float | None = None,
             progress: Callable[[str, int, int | None], None] | None = None) -> GcResult:
    """:func:`plan_gc` over ``backend.iter_objects`` and ``backend.delete_many``.

    ``progress(phase, done, total)`` reports the listing (``"listing"``, objects
    so far, None) every 1,000 objects and the deletes (``"deleting"``, objects
    deleted, objects to delete) after each batch.
    """
    if max_age_s is None and max_bytes is None:
        raise ConfigError("gc needs a maximum age and/or a maximum size")
    now = time.time() if now is None else now
    objs: list[ObjectInfo] = []
    for obj in listed(backend, f"{namespace}/" if namespace else ""):
        objs.append(obj)
        if progress is not None and len(objs) % 1000 == 0:
            progress("listing", len(objs), None)
    doomed = plan_gc(objs, max_age_s=max_age_s, max_bytes=max_bytes, now=now)
    if not dry_run:
        for start in range(0, len(doomed), DELETE_BATCH):
            backend.delete_many([o.name for o in doomed[start:start + DELETE_BATCH]])
            if progress is not None:
                progress("deleting", min(start + DELETE_BATCH, len(doomed)), len(doomed))
    return GcResult(len(objs), sum(o.size for o in objs), len(doomed),
                    sum(o.size for o in doomed), type(backend).supports_delete_many, dry_run)


def gc(tier: Mapping[str, Any], *, max_age_s: float | None = None,
       max_bytes: int | None = None, namespace: str | None = None, dry_run: bool = False,
       progress: Callable[[str, int, int | None], None] | None = None) -> GcResult:
    """Garbage-collect the store a tier dict describes (see :func:`gc_store`)."""
    if max_age_s is None and max_bytes is None:
        raise ConfigError("gc needs a maximum age and/or a maximum size")
    with open_store(tier) as backend:
        result = gc_store(backend, max_age_s=max_age_s, max_bytes=max_bytes,
                          namespace=namespace, dry_run=dry_run, progress=progress)
        if not dry_run:
            backend.sweep_temp_files()  # fs: temp files of writers killed mid-write
        return result
