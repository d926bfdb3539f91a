"""Store statistics: objects, bytes, namespaces and ages (``kvstore-tiers stats``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore_tiers.admin.store import describe_run_config, listed, namespace_of, read_run_config
from kvstore_tiers.backends.base import Backend

#: Upper bounds (seconds) of the age histogram buckets; the last one is open.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60), ("<10m", 600), ("<1h", 3600), ("<6h", 6 * 3600), ("<1d", 86400),
    ("<7d", 7 * 86400), ("<30d", 30 * 86400), (">=30d", float("inf")),
)


@dataclass
class NamespaceStats:
    objects: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    run_config: dict[str, Any] | None = None


@dataclass
class StoreStats:
    """What ``kvstore-tiers stats`` reports: totals, per namespace, ages."""

    objects: int = 0
    bytes: int = 0
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    #: AGE_BUCKETS label -> (objects, bytes)
    ages: dict[str, list[int]] = field(
        default_factory=lambda: {label: [0, 0] for label, _ in AGE_BUCKETS})

    def as_dict(self) -> dict[str, Any]:
        return {
            "objects": self.objects, "bytes": self.bytes,
            "namespaces": {k: {"objects": v.objects, "bytes": v.bytes, "oldest": v.oldest,
                               "newest": v.newest, **describe_run_config(v.run_config)}
                           for k, v in self.namespaces.items()},
            "age_histogram": {k: {"objects": o, "bytes": b} for k, (o, b) in self.ages.items()},
        }


def age_bucket(age_s: float) -> str:
    for label, bound in AGE_BUCKETS:
        if age_s < bound:
            return label
    return AGE_BUCKETS[-1][0]


def collect_stats(backend: Backend, namespace: str | None = None, now: float | None = None,
                  progress: Callable[[int], None] | None = None) -> StoreStats:
    """Count objects and bytes per namespace and by age.

    Ages are from each object's mtime as its backend lists it (fs: mtime,
    the last use when capped; s3: LastModified, the write; redis: the frame's
    created_ms). ``progress(objects listed so far)`` is called every 1,000
    objects and at the end.
    """
    now = time.time() if now is None else now
    st = StoreStats()
    for obj in listed(backend, f"{namespace}/" if namespace else ""):
        ns = st.namespaces.setdefault(namespace_of(obj.name), NamespaceStats())
        ns.objects += 1
        ns.bytes += obj.size
        ns.oldest = obj.mtime if ns.oldest is None else min(ns.oldest, obj.mtime)
        ns.newest = obj.mtime if ns.newest is None else max(ns.newest, obj.mtime)
        st.objects += 1
        st.bytes += obj.size
        bucket = st.ages[age_bucket(max(0.0, now - obj.mtime))]
        bucket[0] += 1
        bucket[1] += obj.size
        if progress is not None and st.objects % 1000 == 0:
            progress(st.objects)
    if progress is not None:
        progress(st.objects)
    for name, ns in st.namespaces.items():
        ns.run_config = read_run_config(backend, name)
    return st
