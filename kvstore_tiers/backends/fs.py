"""The fs backend: one file per block under a local or shared directory.

Layout: ``<root_dir>/<namespace>/<hash[:3]>/<hash>_g<group>.kvf`` plus
``<root_dir>/<namespace>/config.json`` (vLLM's FileMapper run config). The
4,096 shard directories are created once, at the first start on a root_dir,
so a store never pays for a ``mkdir`` (with vLLM's two-level layout a fresh
store made two directories per block), and a directory holds ~2,500 files at
10 million blocks.

* Atomic publish: a frame is written to a unique temp file in the target
  directory and renamed into place; readers never see a torn file, and
  concurrent writers of the same (content-addressed) key are harmless.
* O_DIRECT where the filesystem accepts it (probed at startup; overlayfs,
  tmpfs and NFS answer EINVAL, and we fall back to buffered I/O). Frames are
  written with a 4096-byte header so an uncompressed payload lands, page
  aligned, straight in the primary row with one ``readv``.
* Capacity: ``max_bytes`` and/or ``min_free_bytes``, enforced by
  :mod:`kvstore_tiers.backends.fs_capacity`.
* Each load batch is one open-read-close call for all its files, each store
  batch one create-write-close-rename call (up to eight blocks each;
  :mod:`kvstore_tiers.backends.fs_io`), compiled where a C compiler exists.
* Errors: a missing file is ObjectMissing; a short or malformed file is
  ObjectCorrupt; any other OSError (ENOSPC, EACCES, EIO) is TransientError.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from kvstore_tiers.backends import fs_io
from kvstore_tiers.backends.base import (
    Backend,
    Buffer,
    IOTuning,
    LoadItem,
    ObjectInfo,
    StoreItem,
    classify,
    encode_batch,
)
from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import ConfigError, ObjectCorrupt, ObjectMissing, TransientError
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.namespace import SHARDS

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)
SUFFIX = ".kvf"


class FsConfig(TierConfig):
    """Keys of the fs tier. Also accepts every key of vLLM's stock fs tier."""

    root_dir: str = Field(description="Directory holding the blocks (created if missing).")
    max_bytes: int | None = Field(
        None, gt=0, description="Cap on bytes on disk under root_dir for this namespace; "
        "LRU eviction between high and low watermarks keeps usage below it.",
    )
    min_free_bytes: int | None = Field(
        None, ge=0, description="Free-space floor of the filesystem; eviction keeps it free.",
    )
    high_watermark: float = Field(0.95, gt=0, le=1, description="Evict above this fraction.")
    low_watermark: float = Field(0.85, gt=0, le=1, description="Evict down to this fraction.")
    o_direct: bool = Field(True, description="Use O_DIRECT where the filesystem supports it.")


def _address(buf: Buffer) -> int:
    """Memory address of a buffer's first byte (for O_DIRECT alignment checks).

    On the I/O threads for every block, holding the GIL: ctypes takes ~0.5 us
    for a writable buffer (a primary row), numpy ~4 us (read-only ones).
    """
    if not len(buf):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]
    except TypeError:  # read-only
        import numpy as np

        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _classify_oserror(exc: OSError, path: str) -> Exception:
    if exc.errno == errno.ENOENT:
        return ObjectMissing(path)
    return TransientError(f"{os.strerror(exc.errno or 0)} ({exc.errno}) on {path}")


def probe_o_direct(directory: str) -> bool:
    """True if an aligned O_DIRECT write works in ``directory``."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".o_direct_probe_{uuid.uuid4().hex}")
    page = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.remove(path)


class FileSystemBackend(Backend):
    name = "fs"
    config_model = FsConfig
    remote = False
    supports_touch = True
    supports_read_into = True
    # Up to eight files per I/O task, one GIL-free call for the eight: per-file
    # GIL round trips and pool hand-offs were what kept 256 KiB stores from 4
    # requests at 0.67x of vLLM's tier on tmpfs (0.95x with 8, 0.85x with 4,
    # no gain at 16; docs/benchmarks.md, session 9), and loads pay the same
    # round trips behind a busy scheduler thread. A load job is still spread
    # over every read thread first (a 16-chunk job on 8 threads goes two per
    # task), since loads sit on time-to-first-token. Eight 256 KiB loads per
    # call gained 1.25x over one on tmpfs, 1.07x on the disk; eight 2 MiB ones
    # lost 0.88x on tmpfs (the job waits for its last, larger task), so a load
    # task carries at most 2 MiB of rows. Headers are padded to a page so a
    # raw payload is page aligned for O_DIRECT.
    _TUNING = IOTuning(load_batch=8, store_batch=8, spread_loads=True,
                       max_load_batch_bytes=2 << 20, header_align=PAGE)

    @property
    def tuning(self) -> IOTuning:
        return self._TUNING

    def __init__(self, config: FsConfig, namespace: Any) -> None:
        super().__init__(config, namespace)
        self.root = Path(config.root_dir).expanduser().resolve()
        self.base = self.root / namespace.name
        self._root_prefix = f"{self.root}{os.sep}"
        self.use_o_direct = False
        self._local = threading.local()
        self.capacity: Any = None

    # -- lifecycle ---------------------------------------------------------------
    def open(self) -> None:
        try:
            self.base.mkdir(parents=True, exist_ok=True)
            cfg_path = self.base / "config.json"
            if not cfg_path.exists():
                tmp = cfg_path.with_name(f".config.json.{uuid.uuid4().hex}")
                tmp.write_text(json.dumps(self.namespace.run_config, indent=2, sort_keys=True))
                os.replace(tmp, cfg_path)
            self._make_shards()
            probe = self.base / f".write_probe_{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"fs tier: key 'root_dir': cannot use {str(self.root)!r}: {exc.strerror or exc}"
            ) from None
        self.use_o_direct = self.config.o_direct and probe_o_direct(str(self.base))
        if self.config.o_direct and not self.use_o_direct:
            logger.info("fs tier: O_DIRECT not supported under %s; using buffered I/O", self.root)
        if self.config.max_bytes is not None or self.config.min_free_bytes is not None:
            from kvstore_tiers.backends.fs_capacity import CapacityController

            self.capacity = CapacityController(self.base, self.config, self._on_evicted)
            self.capacity.start()

    def _make_shards(self) -> None:
        """Create the 4,096 shard directories once (a marker file says they exist)."""
        marker = self.base / ".shards"
        if marker.exists():
            return
        for shard in SHARDS:
            (self.base / shard).mkdir(exist_ok=True)
        marker.write_text(f"{len(SHARDS)}\n")

    def close(self) -> None:
        if self.capacity is not None:
            self.capacity.stop()
            self.capacity = None

    def describe(self) -> str:
        cap = f", max_bytes={self.config.max_bytes}" if self.config.max_bytes else ""
        return f"fs root_dir={self.root} (O_DIRECT {'on' if self.use_o_direct else 'off'}{cap})"

    def _on_evicted(self, n_objects: int) -> None:
        self.evicted_objects += n_objects

    # -- paths -------------------------------------------------------------------
    def path(self, name: str) -> str:
        # String concatenation, not pathlib: this runs on every block, holding the GIL.
        return self._root_prefix + name

    def _temp_name(self, path: str) -> str:
        """A name no other writer uses: per-thread random tag + counter (no uuid per block)."""
        local = self._local
        tag = getattr(local, "tag", None)
        if tag is None:
            tag = local.tag = uuid.uuid4().hex[:12]
            local.seq = itertools.count()
        return f"{path}.{tag}{next(local.seq):x}.tmp"

    def _load_pages(self, n: int) -> list[tuple[memoryview, memoryview]]:
        """This thread's page-aligned page pairs for a load batch of ``n`` (for
        O_DIRECT): each file's frame header (its first ``readv`` part) and its
        overflow page."""
        pages: list[tuple[memoryview, memoryview]] = getattr(self._local, "pages", [])
        if len(pages) < n:
            view = memoryview(mmap.mmap(-1, 2 * n * PAGE))
            pages = self._local.pages = [(view[2 * i * PAGE:(2 * i + 1) * PAGE],
                                          view[(2 * i + 1) * PAGE:(2 * i + 2) * PAGE])
                                         for i in range(n)]
        return pages

    def _header_pages(self, n: int) -> list[memoryview]:
        """This thread's page-aligned frame-header pages for a store batch of
        ``n`` (for O_DIRECT: each file's first ``writev`` part)."""
        pages: list[memoryview] = getattr(self._local, "headers", [])
        if len(pages) < n:
            view = memoryview(mmap.mmap(-1, n * PAGE))
            pages = self._local.headers = [view[i * PAGE:(i + 1) * PAGE] for i in range(n)]
        return pages

    # -- bytes -------------------------------------------------------------------
    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Atomically create object ``name`` from ``parts``; False if it exists already."""
        path = self.path(name)
        # O_DIRECT needs page-aligned lengths AND addresses (EINVAL otherwise).
        aligned = self.use_o_direct and all(
            len(p) % PAGE == 0 and _address(p) % PAGE == 0 for p in parts)
        flags = O_DIRECT if aligned else 0
        (res,) = fs_io.publish_files([(self._temp_name(path), path, parts, flags)])
        return self._published(res, path, parts, flags)

    def _published(self, res: int | OSError, path: str, parts: Sequence[Buffer],
                   flags: int) -> bool:
        """One :func:`fs_io.publish_files` outcome: True written, False existed
        already; a failure raises the tier's error for it."""
        try:
            if isinstance(res, FileNotFoundError):  # a shard directory removed under us
                os.makedirs(os.path.dirname(path), exist_ok=True)
                res = fs_io.publish_file(self._temp_name(path), path, parts, flags)
            elif isinstance(res, OSError):
                raise res
        except OSError as exc:
            raise _classify_oserror(exc, path) from exc
        if res and self.capacity is not None:
            self.capacity.on_written(res)
        return bool(res)

    def get(self, name: str) -> bytes:
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise _classify_oserror(exc, path) from exc

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        # One GIL-free call for the batch: a path test per name in Python
        # takes the GIL back after every stat, a wait behind the scheduler.
        path = self.path
        return fs_io.exists_files([path(n) for n in names])

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        from kvstore_tiers.backends.fs_capacity import walk_objects

        for path, st in walk_objects(self.root / prefix if prefix else self.root):
            yield ObjectInfo(os.path.relpath(path, self.root), st.st_size, st.st_mtime)

    def touch_many(self, names: Sequence[str]) -> None:
        if self.capacity is None:
            return  # mtime only matters to the LRU eviction of a capped store
        for n in names:
            with contextlib.suppress(OSError):
                os.utime(self.path(n))

    # -- frames: zero-copy paths -------------------------------------------------
    def store_many(self, items: Sequence[StoreItem], codec: FrameCodec
                   ) -> list[int | BaseException]:
        """Encode every item, then publish them all with one call (the GIL is
        given up once per batch, not once per file)."""
        # No existence check before encoding: the publish makes it inside its
        # one GIL-free call (a separate stat was one more GIL wait per block);
        # the price is a wasted checksum for a block another engine stored.
        out, encoded = encode_batch(items, codec)
        batch: list[fs_io.PublishItem] = []
        headers = self._header_pages(len(encoded))
        for i, header, payload in encoded:
            path = self.path(items[i].name)
            if self.use_o_direct and len(header) == PAGE and len(payload) % PAGE == 0 \
                    and isinstance(payload, memoryview) and _address(payload) % PAGE == 0:
                # Raw payload straight from the page-aligned primary row.
                hdr = headers[len(batch)]
                hdr[:] = header
                batch.append((self._temp_name(path), path, (hdr, payload), O_DIRECT))
            else:
                batch.append((self._temp_name(path), path, (header, payload), 0))
        for (i, _h, _p), (_tmp, path, parts, flags), res in zip(
                encoded, batch, fs_io.publish_files(batch), strict=True):
            try:
                out[i] = self._published(res, path, parts, flags)
            except Exception as exc:
                out[i] = classify(exc)
        return out

    def read_into(self, item: LoadItem, codec: FrameCodec) -> int:
        result = self.load_many((item,), codec)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def load_many(self, items: Sequence[LoadItem], codec: FrameCodec
                  ) -> list[int | BaseException]:
        """Read every item's file with one GIL-free call (:func:`fs_io.read_files`),
        then check and place each frame; per item the frame's size or its error."""
        pages = self._load_pages(len(items))
        batch: list[fs_io.ReadItem] = []
        for item, (hdr, overflow) in zip(items, pages, strict=False):
            # Our own frames: a 4096-byte header then, uncompressed, the row
            # itself -- one vectored read puts the payload where it belongs.
            # A read that stops short of filling the overflow page has met
            # the end of the file, so its length is the file's size without
            # an fstat (on a busy engine every syscall is one more wait for
            # the GIL); only a file that fills it needs one.
            direct = self.use_o_direct and len(item.dest) % PAGE == 0
            batch.append((self.path(item.name), [hdr, item.dest, overflow],
                          O_DIRECT if direct else 0))
        out: list[int | BaseException] = []
        for item, (path, parts, _flags), res in zip(items, batch, fs_io.read_files(batch),
                                                    strict=True):
            try:
                if isinstance(res, OSError):
                    raise _classify_oserror(res, path) from res
                out.append(self._place(item, codec, path, parts[0], res))
            except Exception as exc:
                out.append(classify(exc))
        return out

    def _place(self, item: LoadItem, codec: FrameCodec, path: str, hdr: memoryview,
               read: tuple[int, int]) -> int:
        """Finish one file read with its first page into ``hdr`` and the next
        ``len(item.dest)`` bytes into the row (``read`` = bytes read, file
        size): the frame's checks and decode are :meth:`FrameCodec.receive`'s;
        a raw payload at a page is already in place, anything else is read
        from where the receiver says. Returns the file's size; raises
        ObjectCorrupt for anything but our frame of this key."""
        n, size = read
        rx = codec.receive(item.key, hdr[: min(n, PAGE)], size, item.dest)
        if not (rx.direct and rx.header.header_len == PAGE and n == PAGE + len(item.dest)):
            # Not a raw payload the vectored read put in place (compressed,
            # encrypted, a foreign header length, a short read): read the rest.
            self._pread_into(path, rx.remaining, rx.offset)
        rx.finish()
        self._mark_used(path)
        return size

    def _mark_used(self, path: str) -> None:
        # LRU for the capacity controller: mtime is "last used" (atime is
        # unreliable under relatime/noatime mounts).
        if self.capacity is not None:
            with contextlib.suppress(OSError):
                os.utime(path)

    @staticmethod
    def _pread_into(path: str, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``path`` at ``offset`` (buffered); a short file is ObjectCorrupt."""
        if not len(buf):
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise _classify_oserror(exc, path) from exc
        try:
            n = os.preadv(fd, [buf], offset)
        except OSError as exc:
            raise _classify_oserror(exc, path) from exc
        finally:
            os.close(fd)
        if n != len(buf):
            raise ObjectCorrupt(f"short read of the payload ({n} of {len(buf)} bytes)")
