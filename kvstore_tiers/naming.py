"""Object names: where a block's frame lives in any backend.

``<namespace>/<hash[:3]>/<hash>_g<group>.kvf``: one level of 4,096
hash-derived shards, so no directory holds more than a few thousand files
until billions of blocks, request load spreads over 4,096 S3 prefixes, and
the fs backend creates the shard directories once at start-up (no store
pays for a ``mkdir``).

This module is what backends know of naming: they import it, never
:mod:`kvstore_tiers.namespace` (which knows the model's identity). The
namespace's name itself is an opaque string here.
"""

from __future__ import annotations

#: Suffix of every object (temp files and markers never end with it).
SUFFIX = ".kvf"

#: The shard directories (prefixes) under a namespace: ``000`` .. ``fff``.
SHARDS = [f"{i:03x}" for i in range(4096)]


def object_name(namespace: str, key: bytes) -> str:
    """The object name of OffloadKey ``key`` (block hash + 4-byte group) in ``namespace``."""
    hash_hex = key[:-4].hex()
    group = int.from_bytes(key[-4:], "big")
    return f"{namespace}/{hash_hex[:3]}/{hash_hex}_g{group}{SUFFIX}"


def key_from_object_name(name: str) -> bytes | None:
    """Inverse of :func:`object_name` (None if ``name`` is not one); ``name``
    may be a path or a prefixed key ending in an object name."""
    parts = name.rsplit("/", 2)
    if len(parts) != 3 or not parts[2].endswith(SUFFIX):
        return None
    try:
        hash_hex, group = parts[2][: -len(SUFFIX)].rsplit("_g", 1)
        if not hash_hex.startswith(parts[1]):
            return None
        return bytes.fromhex(hash_hex) + int(group).to_bytes(4, "big")
    except (IndexError, ValueError, OverflowError):
        return None
