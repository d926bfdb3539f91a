"""Listing a redis tier's blocks for administration (stats, verify, gc).

SCAN (every primary in a cluster) + one pipeline of STRLEN and GETRANGE of
the frame's first bytes per 256 keys; an object's time is its frame's
``created_ms`` (Redis keeps no write time), 0 for a value that is not a
frame. Reading the first bytes counts as an access for Redis's LRU clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore_tiers.backends.base import ObjectInfo
from kvstore_tiers.frame import LISTING_READ, created_ms
from kvstore_tiers.naming import SUFFIX

#: Keys per pipeline of STRLEN + GETRANGE.
BATCH = 256

#: How a backend runs one pipeline: ``run(build, items, per=replies per item)``.
Runner = Callable[..., list[Any]]


def iter_objects(client: Any, run: Runner, key_prefix: str, prefix: str = ""
                 ) -> Iterator[ObjectInfo]:
    """Every block under ``key_prefix + prefix``: name (without ``key_prefix``),
    frame size, creation time."""
    for key, size, head in _scan_frames(client, run, key_prefix + prefix):
        yield ObjectInfo(key[len(key_prefix):], size, created_s(head))


def _scan_frames(client: Any, run: Runner, prefix: str) -> Iterator[tuple[str, int, Any]]:
    def head(p: Any, keys: Sequence[str]) -> None:
        for k in keys:
            p.strlen(k)
            p.getrange(k, 0, LISTING_READ - 1)

    def flush(batch: Sequence[str]) -> Iterator[tuple[str, int, Any]]:
        replies = run(head, batch, per=2)
        for i, key in enumerate(batch):
            size, header = replies[2 * i], replies[2 * i + 1]
            if isinstance(size, BaseException) or not size:
                continue  # vanished (expired/evicted) or unreadable right now
            yield key, int(size), header

    batch: list[str] = []
    for raw in client.scan_iter(match=_glob_escape(prefix) + "*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if not key.endswith(SUFFIX):
            continue
        batch.append(key)
        if len(batch) >= BATCH:
            yield from flush(batch)
            batch = []
    if batch:
        yield from flush(batch)


def _glob_escape(text: str) -> str:
    """Escape glob metacharacters for SCAN MATCH."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def created_s(head: Any) -> float:
    """Creation time (s since the epoch) of the frame starting with ``head``; 0 if none."""
    ms = created_ms(head) if isinstance(head, (bytes, bytearray)) else None
    return 0.0 if ms is None else ms / 1000.0
