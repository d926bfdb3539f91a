"""Where an fs namespace's files live.

``<root_dir>/<namespace>/<hash[:3]>/<hash>_g<group>.kvf`` (the object name
from :func:`kvstore_tiers.naming.object_name`, under the root) plus
``<root_dir>/<namespace>/config.json`` (vLLM's FileMapper run config). The
4,096 shard directories are created once, at the first start on a root_dir
(a ``.shards`` marker says so), so a store never pays for a ``mkdir`` (with
vLLM's two-level layout a fresh store made two directories per block), and a
directory holds ~2,500 files at 10 million blocks. A frame is written to a
temp file beside its target (named for its writer, :mod:`.writers`) and
renamed into place.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvstore_tiers.naming import SHARDS, SUFFIX

__all__ = ["SUFFIX", "make_shards", "prepare_namespace_dir", "walk_objects",
           "walk_prefix"]


def prepare_namespace_dir(base: Path, run_config: Mapping[str, Any]) -> None:
    """Make ``base`` ready for stores: the directory, ``config.json``, the
    shard directories; then prove it is writable. Raises OSError."""
    base.mkdir(parents=True, exist_ok=True)
    cfg_path = base / "config.json"
    if not cfg_path.exists():
        tmp = cfg_path.with_name(f".config.json.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(run_config, indent=2, sort_keys=True))
        os.replace(tmp, cfg_path)
    make_shards(base)
    probe = base / f".write_probe_{uuid.uuid4().hex}"
    probe.write_bytes(b"ok")
    probe.unlink()


def make_shards(base: Path) -> None:
    """Create the 4,096 shard directories once (a marker file says they exist)."""
    marker = base / ".shards"
    if marker.exists():
        return
    for shard in SHARDS:
        (base / shard).mkdir(exist_ok=True)
    marker.write_text(f"{len(SHARDS)}\n")


def walk_objects(base: Path | str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, stat) of every object file under ``base``; files that vanish are skipped."""
    for dirpath, _dirs, files in os.walk(base):
        for fn in files:
            if not fn.endswith(SUFFIX):
                continue
            path = os.path.join(dirpath, fn)
            try:
                yield path, os.stat(path)
            except FileNotFoundError:
                continue


def walk_prefix(root: Path, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    """(name, stat) of every object under ``root`` whose name (path relative
    to ``root``, ``/``-separated) starts with ``prefix``; only the
    directories that can hold one are walked."""
    head, _, stem = prefix.rpartition("/")
    top = root / head if head else root
    try:
        entries = list(os.scandir(top))
    except (FileNotFoundError, NotADirectoryError):
        return
    base = f"{head}/" if head else ""
    for entry in entries:
        if not entry.name.startswith(stem):
            continue
        if entry.is_dir(follow_symlinks=False):
            for path, st in walk_objects(entry.path):
                yield base + os.path.relpath(path, top).replace(os.sep, "/"), st
        elif entry.name.endswith(SUFFIX):
            try:
                yield base + entry.name, entry.stat()
            except FileNotFoundError:
                continue
