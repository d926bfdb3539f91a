"""An administrative view of a store: every namespace under the tier's root.

Object names are the backend-neutral ``<namespace>/<aaa>/<hash>_g<group>.kvf``
of :meth:`Namespace.object_name`, relative to the tier's root (fs
``root_dir``, s3 ``prefix``, redis ``key_prefix``); a namespace may itself
contain ``/`` when the store is opened above the root the engines use (an s3
bucket listed without its ``prefix``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvstore_tiers.admin.config import validate_tier
from kvstore_tiers.backends.base import Backend, ObjectInfo
from kvstore_tiers.errors import ConfigError, ObjectMissing
from kvstore_tiers.frame import NAMESPACE_DIGEST_BYTES, created_ms
from kvstore_tiers.namespace import Namespace

#: The namespace an admin store is opened with: the empty name puts its base
#: at the tier's root, so names carry their namespace, and a backend's
#: ``open`` writes no run config for it (it has no run config to write).
ADMIN_NAMESPACE = Namespace(run_config={}, name="", digest=bytes(NAMESPACE_DIGEST_BYTES),
                            dtype_bytes=None)


@contextlib.contextmanager
def open_store(tier: Mapping[str, Any]) -> Iterator[Backend]:
    """A backend over every namespace of the tier, for administration; closed on exit.

    A remote backend is opened, so that a wrong endpoint or credentials fail
    here with its usual message (ConfigError). A local one is not: its
    ``open`` prepares a namespace for an engine's writes (directories, run
    config), which administration must not do; its root must already be a
    directory.
    """
    cls, config = validate_tier(tier)
    backend = cls(config, ADMIN_NAMESPACE)
    if cls.remote:
        backend.open()
    else:
        root = getattr(backend, "root", None)
        if isinstance(root, Path) and not root.is_dir():
            raise ConfigError(f"{cls.name} tier: key {_key_holding(config, root)!r}: "
                              f"{str(root)!r} is not a directory")
    try:
        yield backend
    finally:
        backend.close()


def _key_holding(config: Any, path: Path) -> str:
    """The config key whose value is ``path`` (to name it in a message), else 'root'."""
    for key in type(config).model_fields:
        value = getattr(config, key, None)
        if isinstance(value, str) and value and Path(value).expanduser().resolve() == path:
            return key
    return "root"


def namespace_of(name: str) -> str:
    """The namespace part of an object name: everything before its shard and file."""
    parts = name.rsplit("/", 2)
    return parts[0] if len(parts) == 3 else ""


def read_run_config(backend: Backend, namespace: str) -> dict[str, Any] | None:
    """The vLLM run config a namespace was created with (its ``config.json``), if stored.

    fs and s3 store it beside the namespace's objects (``<ns>/config.json``);
    redis stores none (None). A backend error on this optional object reads
    as unknown too.
    """
    try:
        out = json.loads(bytes(backend.get(f"{namespace}/config.json")))
    except (ObjectMissing, ValueError, OSError):
        return None
    except Exception:  # a backend error on an optional object: report it as unknown
        return None
    return out if isinstance(out, dict) else None


def describe_run_config(cfg: Mapping[str, Any] | None) -> dict[str, str]:
    """model / dtype / layout / identity of a run config, as short strings
    ("?" when unknown; identity "off" when the namespace carries none)."""
    if not cfg:
        return {"model": "?", "dtype": "?", "layout": "?", "identity": "?"}
    layout_keys = ("tp_size", "pp_size", "pcp_size", "dcp_size", "tokens_per_hash",
                   "blocks_per_chunk", "blocks_per_file")
    parts = [f"{k}={cfg[k]}" for k in layout_keys if k in cfg]
    identity = cfg.get("model_identity") or {}
    return {"model": str(cfg.get("model_name", "?")), "dtype": str(cfg.get("dtype", "?")),
            "layout": " ".join(parts) or "?",
            # Digests cut to 12 characters: enough to tell revisions apart at a glance.
            "identity": " ".join(f"{k}={str(v)[:12]}" for k, v in identity.items()) or "off"}


def listed(backend: Backend, prefix: str = "") -> Iterator[ObjectInfo]:
    """``backend.iter_objects(prefix)``, every object's ``mtime`` known: where the
    store keeps no write time (redis), the time its frame's writer recorded
    (:func:`~kvstore_tiers.frame.created_ms` of the listed first bytes; 0 for an
    object that is not a frame)."""
    for obj in backend.iter_objects(prefix):
        if obj.mtime is None:
            ms = created_ms(obj.head) if obj.head else None
            obj = dataclasses.replace(obj, mtime=0.0 if ms is None else ms / 1000.0, head=None)
        yield obj
