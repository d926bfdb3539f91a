"""Every object read back and decoded as a load decodes it (``kvstore-tiers verify``).

The frame is checked by :mod:`kvstore_tiers.frame` only
(:func:`~kvstore_tiers.frame.verify_frame`, through the same
:meth:`FrameCodec.decode_into` a load uses): what verify accepts, a load
accepts, and the other way round. Admin adds the one thing a load knows from
its engine and verify must learn from the object's name: which key and which
namespace the object claims to be.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore_tiers.admin.store import listed, namespace_of
from kvstore_tiers.backends.base import Backend, Buffer, ObjectInfo
from kvstore_tiers.codecs import CodecId
from kvstore_tiers.errors import ObjectCorrupt, ObjectMissing
from kvstore_tiers.frame import CODEC_ENCRYPTED, FrameHeader, verify_frame
from kvstore_tiers.naming import key_from_object_name


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    missing: int = 0  # vanished between listing and reading (evicted, expired)
    #: (object name, reason)
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    deleted: int = 0
    codecs: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "ok": self.ok, "missing": self.missing,
                "corrupt": [{"name": n, "reason": r} for n, r in self.corrupt],
                "deleted": self.deleted, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "codecs": dict(self.codecs)}


def verify_object(name: str, frame: Buffer) -> FrameHeader:
    """Check one stored object fully; returns its header or raises ObjectCorrupt.

    The name must be a block name; the frame is checked by
    :func:`kvstore_tiers.frame.verify_frame` as the block of the key the name
    encodes, in the namespace whose digest starts with the 12 hex digits the
    namespace name ends with (the payload decoded by the same
    :meth:`FrameCodec.decode_into` as a load, its checksum compared; an
    encrypted frame, which needs the tenant's key, up to the payload).
    """
    key = key_from_object_name(name)
    if key is None:
        raise ObjectCorrupt("object name is not a block name")
    ns_hex = namespace_of(name).rsplit("_", 1)[-1]
    try:
        prefix = bytes.fromhex(ns_hex) if len(ns_hex) == 12 else b""
    except ValueError:
        prefix = b""
    return verify_frame(frame, key, prefix)


def _codec_label(codec: int) -> str:
    label = "encrypted+" if codec & CODEC_ENCRYPTED else ""
    try:
        return label + CodecId(codec & ~CODEC_ENCRYPTED).name.lower()
    except ValueError:
        return str(codec)


def verify_store(backend: Backend, *, sample: int | None = None, delete: bool = False,
                 namespace: str | None = None, seed: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read every object (or a random ``sample`` of them) and check it with
    :func:`verify_object`; with ``delete`` remove the corrupt ones."""
    objs: list[ObjectInfo] = list(listed(backend, f"{namespace}/" if namespace else ""))
    if sample is not None and sample < len(objs):
        objs = random.Random(seed).sample(objs, sample)
    rep = VerifyReport()
    doomed: list[str] = []
    for i, obj in enumerate(objs):
        rep.checked += 1
        try:
            frame = backend.get(obj.name)
        except ObjectMissing:
            rep.missing += 1
            continue
        try:
            header = verify_object(obj.name, frame)
        except ObjectCorrupt as exc:
            rep.corrupt.append((obj.name, str(exc)))
            doomed.append(obj.name)
        else:
            rep.ok += 1
            rep.raw_bytes += header.raw_len
            rep.stored_bytes += len(frame)
            rep.codecs[_codec_label(header.codec)] += 1
        if progress is not None:
            progress(i + 1, len(objs))
    if delete and doomed:
        backend.delete_many(doomed)
        rep.deleted = len(doomed)
    return rep
