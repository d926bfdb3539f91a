"""The fs tier's :class:`Backend`: one file per block (layout: :mod:`.layout`).

* Atomic publish: a frame is written to a unique temp file in the target
  directory and renamed into place; readers never see a torn file, and
  concurrent writers of the same (content-addressed) key are harmless.
* O_DIRECT where the filesystem accepts it (probed at startup; overlayfs,
  NFS and older tmpfs answer EINVAL, and we fall back to buffered I/O) and
  is not memory itself (tmpfs, ramfs: buffered, so loads checksum while hot). Frames are
  written with a page-sized header so an uncompressed payload lands, page
  aligned, straight in the primary row with one ``readv`` (:mod:`.direct`).
* Capacity: ``max_bytes`` and/or ``min_free_bytes``, enforced by
  :mod:`.capacity`: every file's room is reserved before it is written.
* Temp files carry their writer's id (:mod:`.writers`); those of writers
  killed mid-write are removed at start, by ``gc`` and by the capacity count.
* A load job is one task whose files are read in one GIL-free call, on up
  to ``n_read_threads`` threads at once inside it; each store batch is one
  create-write-close-rename call of up to eight blocks (:mod:`.fileio`),
  compiled where a C compiler exists. A Python thread takes the GIL back
  once per load, not once per file: on a busy engine, whose scheduler loop
  holds the GIL, each take-back can wait a whole switch interval.
* The backend moves bytes only: a load reads each file into the buffers the
  core planned (a page for the header, the row, a page of tail) with one
  vectored read, checksumming the row while it is in cache
  (``supports_crc32c``); a store writes the buffers it is given, putting the
  row's checksum where the core asks. The frames are the core's.
* Errors: a missing file is ObjectMissing; a short or malformed file is
  ObjectCorrupt; any other OSError (ENOSPC, EACCES, EIO) is TransientError.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstore_tiers.backends.base import (
    Backend,
    Buffer,
    IOTuning,
    ObjectInfo,
    Placed,
    Read,
    ReadDone,
    Write,
    Written,
)
from kvstore_tiers.backends.eviction_log import EvictionLog
from kvstore_tiers.backends.fs import fileio
from kvstore_tiers.backends.fs.config import FsConfig
from kvstore_tiers.backends.fs.fileio import (
    CRC_PIECE,
    O_DIRECT,
    PAGE,
    ThreadPages,
    aligned,
    in_memory,
    probe_o_direct,
    tmpfs_small_pages,
)
from kvstore_tiers.backends.fs.layout import prepare_namespace_dir, walk_prefix
from kvstore_tiers.backends.fs.writers import WriterLock, sweep_stale
from kvstore_tiers.errors import (
    ConfigError,
    ObjectMissing,
    TransientError,
    classify,
)

logger = logging.getLogger(__name__)

# Stores: up to eight files per I/O task, one GIL-free call for the eight:
# per-file GIL round trips and pool hand-offs were what kept small stores
# behind vLLM's tier on tmpfs (fewer per call was slower, more gained
# nothing). Loads: a whole job is one task (up to 64 blocks, the native
# call's bound, and 128 MiB of rows, as a deadlined load's bounce buffer is
# one task's rows), read on the read threads inside that one call, so its
# thread takes the GIL back once behind a busy scheduler loop (the A/Bs are
# in docs/benchmarks.md and its history). Headers are padded to a page so a
# raw payload is page aligned.
TUNING = IOTuning(load_batch=64, store_batch=8, max_load_batch_bytes=128 << 20,
                  header_align=PAGE)


def _classify_oserror(exc: OSError, path: str) -> Exception:
    if exc.errno == errno.ENOENT:
        return ObjectMissing(path)
    return TransientError(f"{os.strerror(exc.errno or 0)} ({exc.errno}) on {path}")


class FileSystemBackend(Backend):
    name = "fs"
    config_model = FsConfig
    remote = False
    #: ``touch_many`` refreshes the mtime LRU of a capped store.
    supports_touch = True
    #: Reads and writes checksum a buffer in their one GIL-free call (the
    #: compiled call on a CPU without the CRC instruction cannot write one).
    supports_crc32c = fileio.PUBLISH_CRC
    supports_capacity = True  # with max_bytes

    def __init__(self, config: FsConfig, namespace: Any) -> None:
        super().__init__(config, namespace)
        self.root = Path(config.root_dir).expanduser().resolve()
        self.base = self.root / namespace.name
        self._root_prefix = f"{self.root}{os.sep}"
        self.use_o_direct = False
        self._crc_piece = 0  # read_files' piece: CRC_PIECE for a root in memory
        self._pages = ThreadPages()
        self.writer: WriterLock | None = None
        self.capacity: Any = None
        self.swept_temp_files = 0

    @property
    def tuning(self) -> IOTuning:
        return TUNING

    # -- lifecycle ---------------------------------------------------------------
    def open(self) -> None:
        try:
            prepare_namespace_dir(self.base, self.namespace.run_config)
        except OSError as exc:
            raise ConfigError(
                f"fs tier: key 'root_dir': cannot use {str(self.root)!r}: {exc.strerror or exc}"
            ) from None
        self.writer = WriterLock(self.base)
        # Temp files of writers killed mid-write: never a live writer's.
        self.swept_temp_files, swept_bytes = sweep_stale(self.base)
        if self.swept_temp_files:
            logger.info("fs tier: removed %d temp files of killed writers (%d KiB) under %s",
                        self.swept_temp_files, swept_bytes >> 10, self.base)
        memory = in_memory(str(self.base))
        self._crc_piece = CRC_PIECE if memory else 0
        self.use_o_direct = self.config.o_direct and not memory and probe_o_direct(str(self.base))
        if self.config.o_direct and memory:
            logger.info("fs tier: %s is in memory (tmpfs or ramfs); using buffered I/O", self.root)
        elif self.config.o_direct and not self.use_o_direct:
            logger.info("fs tier: O_DIRECT not supported under %s; using buffered I/O", self.root)
        if memory and tmpfs_small_pages(str(self.base)):
            logger.info("fs tier: %s is a tmpfs without huge pages: a load copies 4 KiB pages one "
                        "at a time; mount it with huge=within_size for faster loads (docs/fs.md)",
                        self.root)
        if self.config.max_bytes is not None or self.config.min_free_bytes is not None:
            from kvstore_tiers.backends.fs.capacity import CapacityController

            self.evictions = EvictionLog()
            capacity = CapacityController(self.base, self.config, self._on_evicted, self.writer)
            try:
                capacity.start()
            except ConfigError:
                self.close()
                raise
            self.capacity = capacity

    def close(self) -> None:
        if self.capacity is not None:
            self.capacity.stop()
            self.capacity = None
        if self.writer is not None:
            self.writer.close()

    def capacity_usage(self) -> tuple[int, int] | None:
        """Object bytes under the namespace directory and the room ``max_bytes``
        leaves for them, as the capacity controller last counted (no I/O)."""
        cap = self.capacity
        if cap is None or cap.max_bytes is None:
            return None
        return max(0, cap.last_usage - cap.overhead), max(1, cap.max_bytes - cap.overhead)

    def describe(self) -> str:
        cap = f", max_bytes={self.config.max_bytes}" if self.config.max_bytes else ""
        return f"fs root_dir={self.root} (O_DIRECT {'on' if self.use_o_direct else 'off'}{cap})"

    def sweep_temp_files(self) -> int:
        """Remove the temp files of dead writers (killed mid-write) under
        ``root_dir``, every namespace; never a live writer's. Returns the count."""
        files, nbytes = sweep_stale(self.root, walk=True)
        if files:
            logger.info("fs tier: removed %d temp files of killed writers (%d KiB) under %s",
                        files, nbytes >> 10, self.root)
        return files

    def _on_evicted(self, paths: list[str]) -> None:
        # The evictor thread: the keys go to the tier's presence index
        # (through the eviction log), so that it stops answering HIT for them.
        assert self.evictions is not None  # made with the controller
        self.evictions.note_names(paths)

    def _temp_name(self, path: str) -> str:
        assert self.writer is not None, "open() first"
        return self.writer.temp_name(path)

    def path(self, name: str) -> str:
        # String concatenation, not pathlib: this runs on every block, holding the GIL.
        return self._root_prefix + name

    # -- bytes -------------------------------------------------------------------
    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Atomically create object ``name`` from ``parts``; False if it exists already."""
        path = self.path(name)
        flags = O_DIRECT if self.use_o_direct and all(aligned(p) for p in parts) else 0
        (res,) = self._publish([(self._temp_name(path), path, parts, flags)])
        if isinstance(res, BaseException):
            raise res
        return res > 0

    def _publish(self, batch: list[fileio.PublishItem]) -> list[int | BaseException]:
        """Publish ``batch`` (:func:`fileio.publish_files`) within the capacity
        limits; per item the bytes written, 0 if it existed, or the tier's error.
        With a capacity controller every file's room is reserved before it is
        written, so neither ``max_bytes`` nor the ``min_free_bytes`` floor is
        crossed by the writes in flight (:mod:`.capacity`)."""
        cap = self.capacity
        if cap is None:
            return [self._result(res, item) for item, res in
                    zip(batch, fileio.publish_files(batch, self._crc_piece), strict=True)]
        out: list[int | BaseException] = []
        sizes = [cap.size_on_disk(sum(len(p) for p in item[2])) for item in batch]
        while len(out) < len(batch):
            first = len(out)
            granted = cap.reserve(sizes[first:])
            if not granted:
                out += [TransientError(
                    f"no space under max_bytes={self.config.max_bytes} / min_free_bytes="
                    f"{self.config.min_free_bytes} in {self.base}")] * (len(batch) - first)
                break
            part, part_sizes = batch[first:first + granted], sizes[first:first + granted]
            try:
                published = fileio.publish_files(part, self._crc_piece)
            except BaseException:  # nothing of the part was written: give its room back
                for size in part_sizes:
                    cap.release(size, 0)
                raise
            for item, res, size in zip(part, published, part_sizes, strict=True):
                result = self._result(res, item)  # never raises
                cap.release(size, size if isinstance(result, int) and result > 0 else 0)
                out.append(result)
        return out

    def _result(self, res: int | OSError, item: fileio.PublishItem) -> int | BaseException:
        try:
            return self._published(res, item)
        except Exception as exc:
            return classify(exc)

    def _published(self, res: int | OSError, item: fileio.PublishItem) -> int:
        """One :func:`fileio.publish_files` outcome: bytes written, 0 if it
        existed already; a failure raises the tier's error for it."""
        path = item[1]
        try:
            if isinstance(res, FileNotFoundError):  # a shard directory removed under us
                os.makedirs(os.path.dirname(path), exist_ok=True)
                res = fileio.publish_file(self._temp_name(path), path, *item[2:])
            elif isinstance(res, OSError):
                raise res
        except OSError as exc:
            raise _classify_oserror(exc, path) from exc
        return res

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
        return fileio.exists_files([path(n) for n in names])

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for name, st in walk_prefix(self.root, prefix):
            yield ObjectInfo(name, st.st_size, st.st_mtime)

    def touch_many(self, names: Sequence[str]) -> None:
        if self.capacity is None:
            return  # mtime only matters to the LRU eviction of a capped store
        for n in names:
            with contextlib.suppress(OSError):
                os.utime(self.path(n))

    # -- batches: one GIL-free call each -------------------------------------------
    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        """Publish every object with one call (the GIL is given up once per batch,
        not once per file), O_DIRECT where its buffers allow."""
        # No existence check first: the publish makes it inside its one
        # GIL-free call (a separate stat was one more GIL wait per block).
        # That call also checksums a buffer as it writes it where asked, as a
        # load's read does: no GIL re-take per row, and on tmpfs while in cache.
        try:
            return self._publish(self._publish_items(writes))
        except Exception as exc:  # a bad buffer, say: every write of the batch fails alike
            return [classify(exc)] * len(writes)

    def _publish_items(self, writes: Sequence[Write]) -> list[fileio.PublishItem]:
        """The :func:`fileio.publish_files` items of ``writes``: O_DIRECT where a
        page of header then page-aligned buffers allow."""
        batch: list[fileio.PublishItem] = []
        headers = self._pages.header_pages(len(writes))
        for w, hdr in zip(writes, headers, strict=False):  # headers: at least as many
            path = self.path(w.name)
            parts, crc = w.parts, w.crc or ()
            if self.use_o_direct and len(parts[0]) == PAGE and all(
                    isinstance(p, memoryview) and aligned(p) for p in parts[1:]):
                # A page of header, then the rest straight from the page-aligned row.
                hdr[:] = parts[0]
                batch.append((self._temp_name(path), path, (hdr, *parts[1:]), O_DIRECT, *crc))
            else:
                batch.append((self._temp_name(path), path, parts, 0, *crc))
        return batch

    def read_many(self, reads: Sequence[Read]) -> list[ReadDone]:
        """Read every file into its buffers with one GIL-free call
        (:func:`fileio.read_files`) on up to ``n_read_threads`` threads, which
        also checksums the asked buffer of each; O_DIRECT where the buffers are
        page aligned in address and length."""
        direct = self.use_o_direct
        batch: list[fileio.ReadItem] = [
            (self.path(r.name), r.parts,
             O_DIRECT if direct and all(aligned(p) for p in r.parts) else 0,
             -1 if r.crc_part is None else r.crc_part)
            for r in reads]
        try:
            read = fileio.read_files(batch, self.config.n_read_threads, self._crc_piece)
        except Exception as exc:  # a bad buffer, say: every read of the batch fails alike
            err = classify(exc)
            return [(i, err) for i in range(len(reads))]
        out: list[ReadDone] = []
        for i, (path, res) in enumerate(zip((b[0] for b in batch), read, strict=True)):
            if isinstance(res, OSError):
                out.append((i, _classify_oserror(res, path)))
                continue
            n, size, *crc = res
            placed: Placed = (n, size, crc[0] if crc else None)
            out.append((i, placed))
            self._mark_used(path)
        return out

    def _mark_used(self, path: str) -> None:
        # LRU for the capacity controller: mtime is "last used" (atime is
        # unreliable under relatime/noatime mounts).
        if self.capacity is not None:
            with contextlib.suppress(OSError):
                os.utime(path)
