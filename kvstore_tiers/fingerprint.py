"""Model identity: a fingerprint of the files a model is loaded from.

vLLM names a model by its name or path. When the weights at that path change
(a fine-tune saved over the old one, a new revision pulled into the same
directory, a new image with the same model name) the KV cache they produce
changes too, so the namespace must change. :func:`model_identity` returns the
fields folded into the namespace:

* ``revision``: the Hugging Face commit, when the model directory is a
  snapshot of the hub cache (``.../models--org--name/snapshots/<commit>``);
* ``config``: sha256 of the model's ``config.json`` (and the few other files
  that shape KV: quantisation configs, ``params.json``), canonical JSON;
* ``weights``: a digest over every weight file's content fingerprint,
  ``"<mode>:<hex>"``.

Two modes read the weight files:

* ``sampled`` (default): the file size, the whole safetensors header (it
  lists every tensor's name, dtype, shape and byte offsets) and
  :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BYTES` at offsets that depend
  on the size only. About 1 MiB per file whatever its size. Catches every
  re-save, re-quantisation, change of shape or dtype, and any edit touching a
  sampled block; misses an edit of a few tensor values between samples.
* ``full``: BLAKE3 of every byte (the ``blake3`` package vLLM itself depends
  on; it hashes with all cores and releases the GIL), so any edit is caught;
  startup reads the whole model once per file version.

Both are cached per file, keyed by what cannot change without the content
changing (device, inode, size, mtime and ctime in nanoseconds: an in-place
write moves mtime and ctime, a replacement moves the inode, and ctime cannot
be set back from user space), in a user cache directory -- never next to the
model, which may be read-only or shared. The result is the same on every
machine holding the same files: no path, inode or time enters the digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

FingerprintMode = Literal["sampled", "full", "off"]

#: Weight file suffixes fingerprinted (the formats vLLM's loaders read).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
#: Config files that shape the KV cache (head counts and sizes, layer types,
#: sliding windows, quantisation), hashed as canonical JSON.
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "hf_quant_config.json",
                "quant_config.json")
#: Blocks read per file in ``sampled`` mode, and their size.
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 64 << 10
#: A safetensors header longer than this is not believed (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100 << 20
#: Bump when what a digest covers changes: old cache entries are then ignored.
FORMAT = 1
CACHE_ENV = "KVSTORE_TIERS_CACHE"


class FingerprintError(RuntimeError):
    """The model's files could not be found or read."""


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies a model's KV cache beyond its name (see the module doc)."""

    mode: str
    version: str | None = None
    revision: str | None = None
    config: str | None = None
    weights: str | None = None
    files: int = 0
    bytes_read: int = 0  # this process, 0 when every file came from the cache

    def fields(self) -> dict[str, str]:
        """The namespace fields (empty for ``off``: the namespace stays as before)."""
        if self.version is not None:
            return {"model_version": self.version}
        out = {"revision": self.revision, "config": self.config, "weights": self.weights}
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        """One short line for logs."""
        if self.version is not None:
            return f"model_version {self.version}"
        if self.mode in ("off", "unresolved"):
            return f"{self.mode} (model name only)"
        parts = [f"{k} {v[:19]}" for k, v in self.fields().items()]
        return f"{', '.join(parts)} ({self.files} weight file(s))"


def cache_dir() -> Path:
    """``$KVSTORE_TIERS_CACHE/fingerprints``, else ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        base = Path(env).expanduser()
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore-tiers"
    return base / "fingerprints"


# ------------------------------------------------------------------ locating the files
def resolve_model_path(name: str, revision: str | None = None,
                       download_dir: str | None = None) -> Path | None:
    """The local directory (or single file) vLLM loads ``name`` from, or None.

    A path that exists is used as is; a hub id is looked up in the local hub
    cache only (vLLM has downloaded it before any tier starts)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, cache_dir=download_dir,
                                      local_files_only=True))
    except Exception:
        return None


def hub_revision(model_dir: Path) -> str | None:
    """The commit of a hub-cache snapshot directory, else None."""
    parts = Path(os.path.abspath(model_dir)).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-1]
    return None


def weight_files(model_path: Path) -> list[Path]:
    """The weight files of a model directory (top level, sorted), or the file itself."""
    if model_path.is_file():
        return [model_path]
    return sorted(p for p in model_path.iterdir()
                  if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())


def _canonical_json(raw: bytes) -> bytes:
    """``raw`` as canonical JSON (key order and spacing do not matter), or as is."""
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return raw


def config_digest(model_path: Path) -> str | None:
    """sha256 over the KV-shaping config files present, as canonical JSON."""
    if model_path.is_file():
        return None
    h = hashlib.sha256()
    found = False
    for name in CONFIG_FILES:
        p = model_path / name
        if not p.is_file():
            continue
        raw = _canonical_json(p.read_bytes())
        h.update(f"{name}\0{len(raw)}\0".encode())
        h.update(raw)
        found = True
    return h.hexdigest() if found else None


# ------------------------------------------------------------------ one file
def sample_offsets(size: int) -> list[int]:
    """Start offsets of the sampled blocks: the first, the last, and evenly spaced
    ones between; a function of ``size`` only (the same on every machine)."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [0]  # small file: read whole (see _sampled_digest)
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def _safetensors_header(f: object, size: int) -> bytes:
    f.seek(0)  # type: ignore[attr-defined]
    head = f.read(8)  # type: ignore[attr-defined]
    if len(head) < 8:
        return b""
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_SAFETENSORS_HEADER, size - 8):
        return head  # not a safetensors header after all; the samples still count
    return head + f.read(n)  # type: ignore[attr-defined]


def _sampled_digest(path: Path, size: int) -> tuple[str, int]:
    h = hashlib.blake2b(digest_size=32)
    h.update(struct.pack("<Q", size))
    read = 0
    with open(path, "rb", buffering=0) as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            data = f.read()
            h.update(data)
            return h.hexdigest(), len(data)
        if path.suffix == ".safetensors":
            header = _safetensors_header(f, size)
            h.update(struct.pack("<Q", len(header)))
            h.update(header)
            read += len(header)
        for off in sample_offsets(size):
            f.seek(off)
            block = f.read(SAMPLE_BYTES)
            h.update(block)
            read += len(block)
    return h.hexdigest(), read


def _full_digest(path: Path, size: int) -> tuple[str, int]:
    try:
        from blake3 import blake3
    except ImportError:  # vLLM depends on blake3; without it, hashlib's blake2b
        h = hashlib.blake2b(digest_size=32)
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)  # releases the GIL for large buffers
        return h.hexdigest(), size
    h3 = blake3(max_threads=blake3.AUTO)
    if size:
        h3.update_mmap(str(path))
    return h3.hexdigest(), size


_DIGESTERS = {"sampled": _sampled_digest, "full": _full_digest}
_memo: dict[tuple[object, ...], str] = {}
_memo_lock = threading.Lock()


def _stat_key(path: Path, mode: str) -> tuple[object, ...]:
    st = os.stat(path)  # follows symlinks (hub snapshots link to blobs)
    return (FORMAT, mode, os.path.realpath(path), st.st_dev, st.st_ino, st.st_size,
            st.st_mtime_ns, st.st_ctime_ns)


def _cache_file(key: tuple[object, ...]) -> Path:
    return cache_dir() / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.json"


def _cache_get(key: tuple[object, ...]) -> str | None:
    try:
        entry = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):
        return None
    if entry.get("key") != repr(key) or not isinstance(entry.get("digest"), str):
        return None
    return entry["digest"]


def _cache_put(key: tuple[object, ...], digest: str) -> None:
    """Atomic write; an unwritable cache directory only costs a recomputation."""
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": repr(key), "digest": digest}, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("fingerprint cache not written (%s): %s", path, exc)


def file_digest(path: Path, mode: str, use_cache: bool = True) -> tuple[str, int]:
    """``(digest, bytes read)`` of one file in ``mode``; ``bytes read`` is 0 on a cache hit."""
    key = _stat_key(path, mode)
    if use_cache:
        with _memo_lock:
            hit = _memo.get(key)
        if hit is None:
            hit = _cache_get(key)
        if hit is not None:
            with _memo_lock:
                _memo[key] = hit
            return hit, 0
    size = int(key[5])  # type: ignore[call-overload]
    digest, read = _DIGESTERS[mode](path, size)
    if _stat_key(path, mode) != key:
        raise FingerprintError(f"{path} changed while it was fingerprinted")
    if use_cache:
        with _memo_lock:
            _memo[key] = digest
        _cache_put(key, digest)
    return digest, read


# ------------------------------------------------------------------ the model
def weights_digest(files: Iterable[Path], mode: str, use_cache: bool = True) -> tuple[str, int]:
    """``("<mode>:<hex>", bytes read)`` over ``files``, named by base name only."""
    h = hashlib.sha256()
    read = 0
    for p in files:
        d, n = file_digest(p, mode, use_cache)
        h.update(f"{p.name}\0{d}\n".encode())
        read += n
    return f"{mode}:{h.hexdigest()[:32]}", read


def model_identity(model: str, mode: FingerprintMode = "sampled", *,
                   version: str | None = None, revision: str | None = None,
                   download_dir: str | None = None, use_cache: bool = True) -> ModelIdentity:
    """The identity of ``model`` (a path or a hub id) for the namespace.

    ``version`` (the ``model_version`` key) replaces everything else.
    Raises :class:`FingerprintError` when ``mode`` needs the files and they
    cannot be found: the caller fails at startup rather than risk serving KV
    computed by other weights."""
    if version is not None:
        return ModelIdentity(mode="version", version=version)
    if mode == "off":
        return ModelIdentity(mode="off")
    if mode not in _DIGESTERS:
        raise ValueError(f"unknown fingerprint mode {mode!r}")
    path = resolve_model_path(model, revision, download_dir)
    if path is None:
        raise FingerprintError(
            f"model {model!r}: no local files found to fingerprint (not a path, not in "
            "the Hugging Face cache)")
    files = weight_files(path)
    if not files:
        raise FingerprintError(f"model {model!r}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) "
                               f"in {path}")
    try:
        weights, read = weights_digest(files, mode, use_cache)
        config = config_digest(path)
    except OSError as exc:
        raise FingerprintError(f"model {model!r}: cannot read {exc.filename}: {exc}") from exc
    return ModelIdentity(mode=mode, revision=hub_revision(path) if path.is_dir() else None,
                         config=config, weights=weights, files=len(files), bytes_read=read)
