"""The fs tier under vLLM's real TieringOffloadingManager, driven like the scheduler."""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.fs import fileio
from kvstore_tiers.errors import ConfigError

from ...conftest import rows_like

ROW = 16384
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def _objects(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvf"))


@pytest.fixture(params=["native", "python"])
def io_path(request, monkeypatch) -> str:
    """Run a test over both of the fs tier's I/O paths (kvstore_tiers.backends.fs.fileio):
    the compiled ``_fsio`` calls and their pure-Python twins."""
    from kvstore_tiers.backends.fs import _fsio

    native = request.param == "native"
    monkeypatch.setattr(fileio, "publish_file",
                        _fsio.publish_file if native else fileio.publish_file_py)
    monkeypatch.setattr(fileio, "publish_files",
                        _fsio.publish_files if native else fileio.publish_files_py)
    monkeypatch.setattr(fileio, "read_files", _fsio.read_files if native else fileio.read_files_py)
    monkeypatch.setattr(fileio, "exists_files",
                        _fsio.exists_files if native else fileio.exists_files_py)
    return request.param




def test_roundtrip_is_byte_exact(harness_factory, tmp_path, io_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=16, chunk_bytes=ROW)
    keys, rows = make_keys(10), rows_like(10, ROW)
    h.store_all(keys, rows)
    tier = h.tiers[0]
    assert type(tier).__name__ == "FileSystemTier"
    assert tier.counters.objects_stored == 10 and len(_objects(tmp_path)) == 10
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [HIT] * 10
    assert np.array_equal(h.load(keys, ctx), rows)
    assert tier.counters.objects_loaded == 10 and tier.counters.corrupt_objects == 0


def test_a_shard_directory_removed_under_the_tier_is_made_again(
        harness_factory, tmp_path, io_path) -> None:
    """The 4,096 shard directories exist from the first start; one removed
    under the tier (an operator's rm -r) is made again by the next store
    into it, keys sharing it in one batch included, and nothing else moves."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=16,
                        chunk_bytes=ROW)
    (base,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len([p for p in base.iterdir() if p.is_dir()]) == 4096

    first = make_keys(2, seed=5)
    rows = rows_like(4, ROW)
    h.store_all(first, rows[:2])
    gone = base / first[0][:2].hex()[:3]  # the shard of first[0]
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    # Two new keys in the removed shard (same first 3 hex digits), stored in one job.
    again = [first[0][:1] + bytes([first[0][1] ^ m]) + first[0][2:] for m in (0x01, 0x02)]
    h.store_all(again, rows[2:])
    tier = h.tiers[0]
    assert gone.is_dir() and tier.counters.store_failures == 0
    assert tier.counters.objects_stored == 4

    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(again, ctx)
    assert results == [HIT, HIT]
    assert np.array_equal(h.load(again, ctx), rows[2:])


def test_stores_are_published_eight_files_per_call(harness_factory, tmp_path, monkeypatch
                                                  ) -> None:
    # One GIL-free call per store batch is what makes small stores cheap on a
    # busy engine (docs/fs.md); each file keeps its own outcome.
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=32,
                        chunk_bytes=ROW)
    real, calls = fileio.publish_files, []

    def counting(items, *rest):
        calls.append(len(items))
        return real(items, *rest)

    monkeypatch.setattr(fileio, "publish_files", counting)
    keys, rows = make_keys(20, seed=8), rows_like(20, ROW)
    h.store_all(keys, rows)
    assert sorted(calls) == [4, 8, 8]
    assert h.tiers[0].counters.objects_stored == 20 and len(_objects(tmp_path)) == 20
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 20
    assert np.array_equal(h.load(keys, ctx), rows)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_raw_row_is_checksummed_by_the_publish_call(harness_factory, tmp_path, monkeypatch,
                                                     io_path, compression) -> None:
    # A raw row's CRC-32C is computed inside the store batch's one call (no
    # GIL re-take per row): the frame's checksum field, where frame.py says it
    # is, holds the crc32c package's answer. A compressed payload is not the
    # row, so its frame is checksummed before the call.
    import crc32c

    from kvstore_tiers import frame

    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "compression": compression}],
                        chunk_bytes=ROW)
    real, seen = fileio.publish_files, []
    monkeypatch.setattr(fileio, "publish_files", lambda items, *rest:
                        seen.extend(it[4:] for it in items) or real(items, *rest))
    keys, rows = make_keys(6, seed=12), rows_like(6, ROW, seed=12)
    h.store_all(keys, rows)
    sums = compression == "none" and fileio.PUBLISH_CRC
    assert seen and set(seen) == ({(1, frame.CHECKSUM_AT)} if sums else {()})
    for path in _objects(tmp_path):
        header = frame.parse_header(path.read_bytes())
        assert header.checksum != 0
        if compression == "none":
            row = path.read_bytes()[header.header_len:]
            assert header.checksum == crc32c.crc32c(row)
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 6
    assert np.array_equal(h.load(keys, ctx), rows)


def test_a_load_job_is_one_call_on_the_read_threads(harness_factory, tmp_path,
                                                   monkeypatch) -> None:
    # A request's load is one task, read by one GIL-free call on up to
    # n_read_threads threads: its thread takes the GIL back once, not once per
    # file (docs/fs.md). A job of more than 64 blocks is split into tasks.
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 3}],
                        num_chunks=160, chunk_bytes=ROW)
    small, big = make_keys(20, seed=9), make_keys(128, seed=10)
    rows_small, rows_big = rows_like(20, ROW), rows_like(128, ROW, seed=3)
    h.store_all(small, rows_small)
    h.store_all(big, rows_big)
    h.forget_primary()
    real, calls = fileio.read_files, []

    def counting(items, threads=1, piece=0):
        calls.append((len(items), threads))
        return real(items, threads, piece)

    monkeypatch.setattr(fileio, "read_files", counting)
    for keys, rows, expect in ((small, rows_small, [(20, 3)]),
                               (big, rows_big, [(64, 3)] * 2)):
        calls.clear()
        ctx = h.new_request()
        assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * len(keys)
        assert sorted(calls) == expect
        assert np.array_equal(h.load(keys, ctx), rows)
        h.finish_request(ctx)


def test_a_load_task_carries_at_most_128_mib_of_rows() -> None:
    # A deadlined load's bounce buffer holds one task's rows: the bound keeps
    # it at 128 MiB a thread.
    from kvstore_tiers.assembly import plan_batches
    from kvstore_tiers.backends.fs.backend import TUNING

    assert plan_batches(TUNING, 1 << 20) == (8, 64)
    assert plan_batches(TUNING, 5 << 20) == (8, 25)
    assert plan_batches(TUNING, 512 << 20) == (8, 1)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_raw_row_is_checksummed_by_its_read_and_nothing_else_is(
    harness_factory, tmp_path, monkeypatch, compression: str
) -> None:
    # Raw frames: each row's CRC-32C comes from the GIL-free read call, so the
    # crc32c package (which gives the GIL up per row) is not called. Compressed
    # frames: the read is not asked for a checksum of bytes that are not the row.
    from kvstore_tiers import frame
    from kvstore_tiers.backends.fs import _fsio

    if not (fileio.NATIVE and _fsio.CRC32C_INSN):
        pytest.skip("no compiled read call with a CRC-32C instruction here")
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "compression": compression}],
                        chunk_bytes=ROW)
    keys, rows = make_keys(6, seed=21), rows_like(6, ROW, seed=21)
    h.store_all(keys, rows)
    h.forget_primary()
    real_read, real_checksum, crc_of, checksummed = fileio.read_files, frame.checksum, [], []
    monkeypatch.setattr(fileio, "read_files",
                        lambda items, threads=1, piece=0: crc_of.extend(i[3] for i in items)
                        or real_read(items, threads, piece))
    monkeypatch.setattr(frame, "checksum",
                        lambda data: checksummed.append(len(data)) or real_checksum(data))
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 6
    assert np.array_equal(h.load(keys, ctx), rows)
    if compression == "none":
        assert crc_of == [1] * 6 and checksummed == []
    else:
        assert crc_of == [-1] * 6 and len(checksummed) == 6


def test_real_kv_blocks_roundtrip_with_every_codec(
    harness_factory, tmp_path, kv_samples, io_path
) -> None:
    entry, blocks = kv_samples[0]
    row = entry["block_bytes"]
    for codec in ("none", "zstd", "kvsplit"):
        root = tmp_path / codec
        h = harness_factory([{"type": "fs", "root_dir": str(root), "compression": codec}],
                            num_chunks=16, chunk_bytes=row)
        keys = make_keys(len(blocks), seed=3)
        h.store_all(keys, blocks)
        on_disk = sum(p.stat().st_size for p in _objects(root))
        if codec == "kvsplit":
            assert on_disk < 0.75 * blocks.nbytes  # ~1.45x on real bf16 KV
        h.forget_primary()
        ctx = h.new_request()
        assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * len(keys)
        assert np.array_equal(h.load(keys, ctx), blocks), codec


def _fs_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on, as coreutils' ``stat -f`` names it."""
    run = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True,
                         check=True)
    return run.stdout.strip()


@pytest.mark.skipif(shutil.which("stat") is None or not Path("/proc/self/mounts").exists(),
                    reason="needs coreutils' stat and /proc/self/mounts")
def test_a_root_dir_in_memory_is_read_buffered_so_rows_are_checksummed_as_they_land(
    harness_factory, tmp_path, monkeypatch
) -> None:
    # tmpfs takes O_DIRECT from Linux 6.6, but a read there is the kernel's
    # copy all the same; buffered, the read call checksums each piece of a row
    # while it is in cache. A disk keeps O_DIRECT where it takes it, and whole reads.
    real, pieces = fileio.read_files, []
    monkeypatch.setattr(fileio, "read_files", lambda items, threads=1, piece=0:
                        pieces.append(piece) or real(items, threads, piece))
    for root in (Path("/dev/shm"), tmp_path):
        if not root.is_dir():
            continue
        memory = _fs_type(root) in ("tmpfs", "ramfs")
        assert fileio.in_memory(str(root)) == memory, root
        sub = Path(tempfile.mkdtemp(dir=root))
        try:
            h = harness_factory([{"type": "fs", "root_dir": str(sub)}], chunk_bytes=ROW)
            backend = h.tiers[0].backend
            assert backend.use_o_direct == (not memory and fileio.probe_o_direct(str(sub)))
            keys, rows = make_keys(4, seed=5), rows_like(4, ROW, seed=5)
            h.store_all(keys, rows)
            h.forget_primary()
            pieces.clear()
            ctx = h.new_request()
            assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 4
            assert np.array_equal(h.load(keys, ctx), rows)
            assert pieces and set(pieces) == {fileio.CRC_PIECE if memory else 0}
        finally:
            shutil.rmtree(sub, ignore_errors=True)
    assert not fileio.in_memory(str(tmp_path / "no such directory"))


def test_in_memory_reads_the_mount_table(tmp_path) -> None:
    # The last mount over a path decides; escaped mount points are unescaped.
    table = tmp_path / "mounts"
    table.write_text("/dev/vda1 / ext4 rw 0 0\n"
                     "tmpfs /mnt/a\\040b tmpfs rw 0 0\n"
                     "tmpfs /mnt/c tmpfs rw 0 0\n"
                     "/dev/vdb /mnt/c xfs rw 0 0\n"
                     "ramfs /r ramfs rw 0 0\n")
    mounts = str(table)
    assert fileio.in_memory("/mnt/a b/x", mounts) and fileio.in_memory("/r", mounts)
    assert not fileio.in_memory("/mnt/c/x", mounts)  # xfs mounted over the tmpfs
    assert not fileio.in_memory("/mnt/ab", mounts) and not fileio.in_memory("/var", mounts)
    assert not fileio.in_memory("/r", str(tmp_path / "no table"))


def test_tmpfs_small_pages_reads_the_mount_options_and_the_kernels_policy(tmp_path) -> None:
    # A tmpfs keeps files in 4 KiB pages unless mounted huge=always or
    # huge=within_size, or the kernel forces (or denies) huge pages for all.
    table = tmp_path / "mounts"
    table.write_text("/dev/vda1 / ext4 rw,relatime 0 0\n"
                     "tmpfs /small tmpfs rw,relatime,size=1024k 0 0\n"
                     "tmpfs /advise tmpfs rw,huge=advise 0 0\n"
                     "tmpfs /within tmpfs rw,size=4g,huge=within_size 0 0\n"
                     "tmpfs /always tmpfs rw,huge=always 0 0\n"
                     "ramfs /r ramfs rw 0 0\n")
    policy = tmp_path / "shmem_enabled"

    def small(path: str, chosen: str | None = "never") -> bool:
        if chosen is None:
            return fileio.tmpfs_small_pages(path, str(table), str(tmp_path / "none"))
        policy.write_text(" ".join(f"[{w}]" if w == chosen else w for w in
                                   ("always", "within_size", "advise", "never", "deny", "force")))
        return fileio.tmpfs_small_pages(path, str(table), str(policy))

    assert small("/small/kv") and small("/advise")
    assert not small("/small", None)  # no shmem_enabled: a kernel without huge pages
    assert not small("/within/kv") and not small("/always")
    assert not small("/r") and not small("/var")  # not a tmpfs
    assert not small("/small", "force") and not small("/small", "deny")
    assert small("/small", "within_size")  # the policy for the kernel's own mount only


@pytest.mark.skipif(shutil.which("findmnt") is None or not Path("/dev/shm").is_dir(),
                    reason="needs util-linux's findmnt and /dev/shm")
def test_a_tmpfs_without_huge_pages_is_named_at_start(harness_factory, caplog) -> None:
    run = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,OPTIONS", "--target", "/dev/shm"],
                         capture_output=True, text=True, check=True)
    kind, options = run.stdout.splitlines()[-1].split()  # the last mount over it
    forced = re.search(r"\[(\w+)\]", Path(fileio._SHMEM_ENABLED).read_text()
                       if Path(fileio._SHMEM_ENABLED).exists() else "")
    small = (kind == "tmpfs" and "huge=always" not in options and "huge=within_size" not in
             options and (forced is None or forced.group(1) not in ("force", "deny")))
    assert fileio.tmpfs_small_pages("/dev/shm") == small
    sub = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        with caplog.at_level(logging.INFO, logger="kvstore_tiers"):
            harness_factory([{"type": "fs", "root_dir": str(sub)}], chunk_bytes=ROW)
        named = [r for r in caplog.records if "huge=within_size" in r.getMessage()]
        assert len(named) == (1 if small else 0)
    finally:
        shutil.rmtree(sub, ignore_errors=True)


def test_second_manager_hits_what_the_first_stored(harness_factory, tmp_path) -> None:
    """A fresh engine (new manager, empty presence index) finds blocks on disk."""
    cfg = [{"type": "fs", "root_dir": str(tmp_path)}]
    keys, rows = make_keys(6, seed=5), rows_like(6, ROW, seed=5)
    harness_factory(cfg, chunk_bytes=ROW).store_all(keys, rows)
    h2 = harness_factory(cfg, chunk_bytes=ROW)
    ctx = h2.new_request()
    results, steps = h2.lookup_until_resolved(keys + make_keys(2, seed=99), ctx)
    assert results == [HIT] * 6 + [MISS] * 2
    assert steps >= 2  # unknown keys go through the asynchronous check (RETRY first)
    assert np.array_equal(h2.load(keys, ctx), rows)


def test_existing_objects_are_not_rewritten(harness_factory, tmp_path, io_path) -> None:
    cfg = [{"type": "fs", "root_dir": str(tmp_path)}]
    keys, rows = make_keys(4, seed=7), rows_like(4, ROW)
    harness_factory(cfg, chunk_bytes=ROW).store_all(keys, rows)
    mtimes = [p.stat().st_mtime_ns for p in _objects(tmp_path)]
    h2 = harness_factory(cfg, chunk_bytes=ROW)
    h2.store_all(keys, rows)
    assert h2.tiers[0].counters.objects_skipped == 4
    assert h2.tiers[0].counters.objects_stored == 0
    assert [p.stat().st_mtime_ns for p in _objects(tmp_path)] == mtimes


def _foreign_object(tmp_path: Path, key: bytes) -> bytes:
    """The frame another model's namespace stores for the same block key."""
    from kvstore_tiers.admin.harness import build_harness

    other = tmp_path / "other"
    h = build_harness([{"type": "fs", "root_dir": str(other)}], chunk_bytes=ROW, model="org/other")
    try:
        h.store_all([key], rows_like(1, ROW, seed=42))
    finally:
        h.shutdown()
    (obj,) = _objects(other)
    return obj.read_bytes()


def test_corrupt_truncated_foreign_objects_are_misses_never_wrong_bytes(
    harness_factory, tmp_path, io_path
) -> None:
    root = tmp_path / "kv"
    cfg = [{"type": "fs", "root_dir": str(root)}]
    keys, rows = make_keys(10, seed=11), rows_like(10, ROW, seed=11)
    harness_factory(cfg, chunk_bytes=ROW).store_all(keys, rows)
    tier_ns = harness_factory(cfg, chunk_bytes=ROW).tiers[0].namespace
    path_of = {k: root / tier_ns.object_name(k) for k in keys}
    # 0: bit flip in the payload; 1: truncated; 2: zeroed (same length);
    # 3: another namespace's object for the same key; 4: empty; 5: a page
    # appended, 6: ten bytes appended (intact frame, longer file); 7-9 intact.
    data = bytearray(path_of[keys[0]].read_bytes())
    data[-100] ^= 0x40
    path_of[keys[0]].write_bytes(bytes(data))
    path_of[keys[1]].write_bytes(path_of[keys[1]].read_bytes()[:-4096])
    path_of[keys[2]].write_bytes(bytes(path_of[keys[2]].stat().st_size))
    path_of[keys[3]].write_bytes(_foreign_object(tmp_path, keys[3]))
    path_of[keys[4]].write_bytes(b"")
    with path_of[keys[5]].open("ab") as f:
        f.write(bytes(4096))
    with path_of[keys[6]].open("ab") as f:
        f.write(b"0123456789")

    h = harness_factory(cfg, chunk_bytes=ROW)
    tier = h.tiers[0]
    ctx = h.new_request()
    # The damaged objects exist, so the existence check says HIT; the load
    # then rejects them and the same request sees MISS from then on.
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results[7:] == [HIT] * 3
    assert results[:7] == [MISS] * 7
    assert tier.counters.corrupt_objects == 7
    assert all(not path_of[k].exists() for k in keys[:7])  # removed
    assert np.array_equal(h.load(keys[7:], ctx), rows[7:])


def test_partial_promotion_failure_keeps_the_good_keys(
    harness_factory, tmp_path, io_path
) -> None:
    cfg = [{"type": "fs", "root_dir": str(tmp_path)}]
    h = harness_factory(cfg, chunk_bytes=ROW)
    keys, rows = make_keys(6, seed=13), rows_like(6, ROW, seed=13)
    h.store_all(keys, rows)
    h.forget_primary()
    # The presence index answers HIT at once; the files of two keys vanish
    # before the promotion runs (evicted by another engine, say).
    ns = h.tiers[0].namespace
    for k in (keys[1], keys[4]):
        (tmp_path / ns.object_name(k)).unlink()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [HIT, MISS, HIT, HIT, MISS, HIT]
    good = [keys[i] for i in (0, 2, 3, 5)]
    assert np.array_equal(h.load(good, ctx), rows[[0, 2, 3, 5]])
    assert h.tiers[0].counters.load_misses == 2


def test_store_errors_fail_the_job_and_the_tier_stays_usable(
    harness_factory, tmp_path, monkeypatch
) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], chunk_bytes=ROW)
    real_publish = fileio.publish_files
    # ENOSPC and EACCES cannot be had on demand here (the tests run as root
    # on a roomy disk): injected where the one publish call returns them.
    for code in (errno.ENOSPC, errno.EIO, errno.EACCES):
        def failing(items, *_rest, _code=code):
            return [OSError(_code, os.strerror(_code), it[0]) for it in items]
        monkeypatch.setattr(fileio, "publish_files", failing)
        h.store_all(make_keys(2, seed=code), rows_like(2, ROW))
        monkeypatch.setattr(fileio, "publish_files", real_publish)
    tier = h.tiers[0]
    assert tier.counters.store_failures == 6 and tier.counters.objects_stored == 0
    keys, rows = make_keys(3, seed=1000), rows_like(3, ROW)
    h.store_all(keys, rows)
    assert tier.counters.objects_stored == 3
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 3


def test_a_real_short_write_fails_the_store_and_leaves_no_file(
    harness_factory, tmp_path, io_path
) -> None:
    # RLIMIT_FSIZE makes the kernel cut every write short of the frame, the
    # way a full disk does: a real error through the real publish path.
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], chunk_bytes=ROW)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ROW // 2, hard))
    try:
        h.store_all(make_keys(3, seed=99), rows_like(3, ROW))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    tier = h.tiers[0]
    assert tier.counters.store_failures == 3 and tier.counters.objects_stored == 0
    assert _objects(tmp_path) == [] and not list(tmp_path.rglob("*.tmp"))
    keys, rows = make_keys(2, seed=100), rows_like(2, ROW)
    h.store_all(keys, rows)
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 2
    assert np.array_equal(h.load(keys, ctx), rows)


def test_load_io_error_is_a_failed_key_not_an_exception(
    harness_factory, tmp_path, monkeypatch
) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], chunk_bytes=ROW)
    keys, rows = make_keys(3, seed=17), rows_like(3, ROW)
    h.store_all(keys, rows)
    h.forget_primary()

    def eio(items, threads=1, piece=0):
        return [OSError(errno.EIO, "Input/output error", it[0]) for it in items]

    # A load batch is one compiled call (or its Python twin), which returns
    # each file's error: inject there.
    monkeypatch.setattr(fileio, "read_files", eio)
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [MISS] * 3
    assert h.tiers[0].counters.load_failures == 3
    assert all((tmp_path / h.tiers[0].namespace.object_name(k)).exists() for k in keys)


def test_in_flight_stores_are_skipped_and_only_reported_ones_hit(
    harness_factory, tmp_path, monkeypatch
) -> None:
    """The presence index's contract for this process's own stores.

    While a store is in flight a second store of its keys is skipped (no
    duplicate write) and lookups do not answer HIT from the index (the object
    is not there yet); once the job's completion is reported they answer HIT
    at once; keys whose store failed are forgotten, so a later store writes
    them.
    """
    import gc

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvstore_tiers.presence import StoreReceipt

    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=8,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(4, seed=31)
    ctx = ReqContext(req_id="r1")
    gate, real_publish = threading.Event(), fileio.publish_files

    def gated_publish(items, *rest):
        assert gate.wait(30)
        # Slot 3's row fails; the rest of its batch is written.
        return [OSError(errno.EIO, "Input/output error", it[0])
                if len(it[2][1]) == ROW and bytes(it[2][1][:1]) == b"\x03"
                else real_publish([it], *rest)[0] for it in items]

    monkeypatch.setattr(fileio, "publish_files", gated_publish)
    for i in range(4):
        h.view[i] = i
    with h.locked():
        tier.submit_store(TransferJob(1, keys, np.arange(4), False, ctx))
        tier.submit_store(TransferJob(2, keys[:2], np.arange(2), False, ctx))
        done = list(tier.get_finished_jobs())
        # Job 2's keys were all in flight: reported stored at once, nothing queued.
        assert [(r.job_id, r.success) for r in done] == [(2, True)]
        assert tier.counters.objects_skipped == 2
        assert tier.lookup(keys[0], ctx) is not LookupResult.HIT  # not written yet
    gate.set()
    tier.pool.wait_idle()  # the I/O threads are done; the job awaits its report
    with h.locked():
        results = list(tier.get_finished_jobs())
    assert [(r.job_id, r.success) for r in results] == [(1, False)]
    with h.locked():
        # Reported: the three written keys hit from the index (no RETRY step),
        # the failed one is forgotten.
        fresh = ReqContext(req_id="r2")
        assert [tier.lookup(k, fresh) for k in keys[:3]] == [HIT] * 3
        assert keys[3] not in tier.presence
        assert tier.counters.objects_stored == 3 and tier.counters.store_failures == 1
        # The index keeps a receipt, not the job (its rows, keys and outcomes).
        assert all(type(tier.presence[k]) is StoreReceipt for k in keys[:3])
        assert not gc.is_tracked(tier.presence[keys[0]])  # no cost to the next GC pass
    # A later store of the failed key writes it (the disk works again).
    monkeypatch.setattr(fileio, "publish_files", real_publish)
    h.view[3] = 9
    with h.locked():
        tier.submit_store(TransferJob(3, keys[3:], np.arange(3, 4), False, ctx))
    tier.pool.wait_idle()
    with h.locked():
        results = list(tier.get_finished_jobs())
    assert [(r.job_id, r.success) for r in results] == [(3, True)]
    assert tier.counters.objects_stored == 4
    assert len(_objects(tmp_path)) == 4


def test_a_submit_starts_a_gc_pass_only_within_three_of_the_threshold(
    harness_factory, tmp_path
) -> None:
    """vLLM's scheduler thread runs whichever cyclic-GC pass its allocations
    start (100-150 us here). A pass starts at the first allocation that takes
    CPython's gen-0 counter past its threshold, so what a submit risks is the
    most it ever has the counter above where it found it: measured here as
    the least headroom (threshold minus counter at entry) with which the
    call starts no pass. Three (the job, its row-id list, one iterator at a
    time), for 1 chunk as for 16, stores and loads; it was 14 for a store and
    11 for a load when a submit made the per-slot lists, a lock, a receipt,
    a batch dict and three closure cells. The jobs still succeed and the
    loads bring the rows back byte-exact."""
    import gc

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=64,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    rows = rows_like(16, ROW, seed=4)
    h.view[:16] = rows
    ctx = ReqContext(req_id="r")
    threshold = 300

    def starts_a_pass(submit, job, headroom: int) -> bool:
        started: list[int] = []

        def on_gc(phase: str, _info: dict) -> None:
            started.append(phase == "start")

        saved = gc.get_threshold()
        gc.callbacks.append(on_gc)
        # The pool's lock (never taken by a submit) keeps the I/O threads
        # from allocating meanwhile.
        with tier.pool._lock:
            gc.disable()
            try:
                gc.collect(0)
                started.clear()
                gc.set_threshold(threshold, *saved[1:])
                pad = []  # young objects: they set the counter
                while gc.get_count()[0] < threshold - headroom:
                    pad.append([])
                gc.enable()
                submit(job)
                gc.disable()
            finally:
                gc.set_threshold(*saved)
                gc.enable()
        gc.callbacks.remove(on_gc)
        return any(started)

    job_ids = iter(range(1, 1000))
    stored: dict[int, list[bytes]] = {}  # keys of one store job per size

    def least_headroom(submit, is_load: bool, n: int) -> int:
        for headroom in range(16):
            # What a submit allocates is the same every time; another thread
            # of the process (vLLM's own, a previous test's server) may
            # allocate during one call. So a headroom is too small only if
            # every one of three tries starts a pass.
            for _try in range(3):
                job_id = next(job_ids)
                keys = stored[n] if is_load else make_keys(n, seed=job_id)
                stored.setdefault(n, keys)
                with h.locked():
                    job = TransferJob(job_id, keys, np.arange(n), is_load, ctx)
                    if not starts_a_pass(submit, job, headroom):
                        return headroom
        return 16

    needed = {}
    for is_load, submit in ((False, tier.submit_store), (True, tier.submit_load)):
        for n in (1, 16):
            needed[submit.__name__, n] = least_headroom(submit, is_load, n)
        tier.pool.wait_idle()
        with h.locked():
            results = list(tier.get_finished_jobs())
        assert results and all(r.success for r in results)
        if not is_load:
            h.view[:16] = 0  # the loads must bring the rows back
    assert np.array_equal(h.view[:16], rows)
    assert max(needed.values()) <= 3, needed


def test_a_job_whose_completion_breaks_is_still_reported_failed(
    harness_factory, tmp_path, monkeypatch
) -> None:
    """A bug while applying a finished job must not leave vLLM waiting on it forever."""
    from kvstore_tiers import outcome

    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], chunk_bytes=ROW)
    keys, rows = make_keys(3, seed=23), rows_like(3, ROW)
    h.store_all(keys, rows)
    h.forget_primary()

    def broken(job):  # injected fault: condensing the outcomes raises
        raise RuntimeError("injected")

    monkeypatch.setattr(outcome.Summary, "of", staticmethod(broken))
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [MISS] * 3  # failed, not stuck in RETRY
    with h.locked():
        assert not h.manager.has_pending_work()
    assert h.tiers[0].counters.load_failures == 3
    monkeypatch.undo()
    h.finish_request(ctx)
    ctx = h.new_request()  # a later request promotes them normally
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 3


def test_unusable_root_dir_fails_startup_naming_it(tmp_path) -> None:
    from kvstore_tiers.admin.harness import build_harness

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="root_dir"):
        build_harness([{"type": "fs", "root_dir": str(blocker / "sub")}])


def test_bad_key_fails_startup_naming_it(tmp_path) -> None:
    from kvstore_tiers.admin.harness import build_harness

    with pytest.raises(ConfigError, match="'max_byts'"):
        build_harness([{"type": "fs", "root_dir": str(tmp_path), "max_byts": 1}])


def test_missing_root_dir_is_created(harness_factory, tmp_path) -> None:
    root = tmp_path / "a" / "b"
    h = harness_factory([{"type": "fs", "root_dir": str(root)}])
    assert (root / h.tiers[0].namespace.name / "config.json").exists()


def test_reset_cache_drains_and_reports_every_job(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 1,
                          "n_write_threads": 1}], num_chunks=64, chunk_bytes=ROW)
    keys, rows = make_keys(48, seed=19), rows_like(48, ROW)
    ctx = h.store(keys, rows)
    h.forget_primary()  # drain_jobs with stores queued, then the manager asserts no job is left
    h.finish_request(ctx)
    h.settle()
    c = h.tiers[0].counters
    assert c.objects_stored + c.store_failures + c.transfers_cancelled == 48  # all accounted
    again = make_keys(4, seed=20)
    h.store_all(again, rows[:4])
    assert c.objects_stored >= 4


@pytest.mark.parametrize("corrupt_load", [False, True])
def test_shutdown_releases_the_primary_and_stops_threads(tmp_path, corrupt_load) -> None:
    from kvstore_tiers.admin.harness import build_harness

    before = {t.ident for t in threading.enumerate()}
    h = build_harness([{"type": "fs", "root_dir": str(tmp_path)}], chunk_bytes=ROW)
    keys = make_keys(3)
    h.store_all(keys, rows_like(3, ROW))
    if corrupt_load:
        # A rejected object's error must not keep a view of the primary alive
        # (its traceback's frames hold the row it was loading into).
        path = _objects(tmp_path)[0]
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(data)
        h.forget_primary()
        ctx = h.new_request()
        results, _ = h.lookup_until_resolved(keys, ctx)
        h.finish_request(ctx)
        assert results.count(MISS) == 1
    mm = h.spec._scheduler_mmap.mmap_obj
    h.shutdown()
    h.tiers[0].shutdown()  # idempotent
    leftover = [t.name for t in threading.enumerate() if t.ident not in before]
    assert leftover == []
    with pytest.raises(ValueError):  # closed: no exported view kept it mapped
        len(mm)


@pytest.mark.parametrize("linger_s", [0.0, 60.0])
def test_store_polling_follows_its_config_keys(harness_factory, tmp_path, linger_s) -> None:
    """``store_linger_s: 0`` leaves no store thread polling once stores are
    done (no idle wake-ups); otherwise one polls every ``store_poll_ms``."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "store_poll_ms": 50,
                          "store_linger_s": linger_s}], num_chunks=8, chunk_bytes=ROW)
    pool = h.tiers[0].pool
    assert pool._store_poll_s == 0.05
    keys = make_keys(4, seed=3)
    h.store_all(keys, rows_like(4, ROW))
    assert h.tiers[0].counters.objects_stored == 4
    seen = []
    end = time.monotonic() + 0.3  # six poll periods
    while time.monotonic() < end:
        seen.append(pool._polling_stores)
        time.sleep(0.005)
    assert any(seen) is bool(linger_s)


def test_events_and_metrics(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "enable_kv_events": True}],
                        chunk_bytes=ROW)
    keys = make_keys(3, seed=23)
    h.store_all(keys, rows_like(3, ROW))
    tier = h.tiers[0]
    events = list(tier.take_events())
    assert [sorted(e.keys) for e in events] == [sorted(keys)]
    assert events[0].removed is False and events[0].medium.value == "STORAGE"
    assert list(tier.take_events()) == []
    defs = type(tier).build_metric_definitions({"type": "fs"})
    stats = tier.get_stats()
    assert stats is not None and not stats.is_empty()
    data = stats.data
    names = set()
    for section in data.values():
        if isinstance(section, dict):
            names |= set(section)
    assert "vllm:kvstore_objects_stored" in names
    assert names <= set(defs)
