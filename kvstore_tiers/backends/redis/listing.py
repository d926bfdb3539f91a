"""Listing a redis tier's blocks for administration (stats, verify, gc).

SCAN (every primary in a cluster) + one pipeline of STRLEN and GETRANGE of
the value's first :data:`~kvstore_tiers.backends.base.LISTING_HEAD` bytes per
256 keys: Redis keeps no write time, so the listing gives those bytes and
the core reads the time its writer recorded there. Reading the first bytes
counts as an access for Redis's LRU clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore_tiers.backends.base import LISTING_HEAD, ObjectInfo
from kvstore_tiers.naming import SUFFIX

#: Keys per pipeline of STRLEN + GETRANGE.
BATCH = 256

#: How a backend runs one pipeline: ``run(build, items, per=replies per item)``.
Runner = Callable[..., list[Any]]


def iter_objects(client: Any, run: Runner, key_prefix: str, prefix: str = ""
                 ) -> Iterator[ObjectInfo]:
    """Every block under ``key_prefix + prefix``: name (without ``key_prefix``),
    size, and its first bytes (no time: Redis keeps none)."""
    for key, size, head in _scan_frames(client, run, key_prefix + prefix):
        yield ObjectInfo(key[len(key_prefix):], size, None,
                         bytes(head) if isinstance(head, (bytes, bytearray)) else b"")


def _scan_frames(client: Any, run: Runner, prefix: str) -> Iterator[tuple[str, int, Any]]:
    def head(p: Any, keys: Sequence[str]) -> None:
        for k in keys:
            p.strlen(k)
            p.getrange(k, 0, LISTING_HEAD - 1)

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
