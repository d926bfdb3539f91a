"""Fault matrix, fs backend: killed writers, ENOSPC/EACCES/EIO, tampered objects, stalls."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.fs import fileio as fs_io

from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix, score

BACKEND = "fs"


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[Driver]:
    d = Driver(BACKEND, [{"type": "fs", "root_dir": str(tmp_path / "kv"),
                          "failure_threshold": 1000}])
    yield d
    assert d.close() == 0


_WRITER = r"""
import json, mmap, sys
import numpy as np
from kvstore_tiers.backends.fs import FileSystemBackend, FsConfig
from kvstore_tiers.batching import StoreItem, store_many
from kvstore_tiers.codecs import CodecId
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.namespace import Namespace

root, run_config = sys.argv[1], json.loads(sys.argv[2])
row_bytes, n = int(sys.argv[3]), int(sys.argv[4])
ns = Namespace.from_run_config(run_config)
be = FileSystemBackend(FsConfig(root_dir=root), ns)
be.open()
codec = FrameCodec(ns.digest, CodecId.NONE, be.tuning.header_align)
for i, k in enumerate(make_keys(n, seed=77)):
    row = mmap.mmap(-1, row_bytes)  # page aligned, like a primary row: the O_DIRECT path
    row[:] = np.random.default_rng(int.from_bytes(k[:8], "little")).integers(
        0, 256, row_bytes, dtype=np.uint8).tobytes()
    print(f"start {i}", flush=True)
    (res,) = store_many(be, [StoreItem(ns.object_name(k), k, memoryview(row))], codec)
    assert not isinstance(res, BaseException), res
    print(f"done {i}", flush=True)
"""


def test_writer_killed_mid_write_leaves_no_torn_object(tmp_path: Path) -> None:
    """SIGKILL a process writing 2 MiB blocks; every visible object verifies or is absent."""
    row = 2 << 20
    root = tmp_path / "kv"
    d = Driver(BACKEND, [{"type": "fs", "root_dir": str(root)}], num_chunks=8, chunk_bytes=row)
    try:
        n = 400
        keys = make_keys(n, seed=77)
        run_config = {k: v for k, v in d.tier.namespace.run_config.items()}
        kills = 0
        for attempt in range(3):
            proc = subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(root), json.dumps(run_config), str(row),
                 str(n)], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            # Kill it in the middle of a write: right after a "start" line.
            for line in proc.stdout:
                if line.startswith("start") and int(line.split()[1]) >= 3 + 5 * attempt:
                    time.sleep(0.002 * attempt)
                    proc.kill()
                    kills += 1
                    break
            proc.wait()
        d.score.fault("writer_sigkill", kills)
        tmps = list(root.rglob("*.tmp"))
        objs = list(root.rglob("*.kvf"))
        # Leftover temp files are never listed or read as objects.
        listed = {o.name for o in d.tier.backend.iter_objects()}
        assert not any(name.endswith(".tmp") for name in listed)
        assert len(listed) == len(objs)
        checked = keys[:24]  # beyond every kill point
        for k, r in zip(checked, rows_for(checked, row), strict=True):
            d.expected[k] = r.tobytes()
        for i in range(0, len(checked), 4):
            res = d.fetch(checked[i : i + 4])
            # A HIT is verified byte-exact by fetch; a MISS is an absent object.
            assert all(r in (HIT, MISS) for r in res)
        assert d.score.wrong_bytes == 0
        print(f"killed {kills} writers; {len(objs)} objects, {len(tmps)} leftover .tmp files")
    finally:
        assert d.close() == 0


class _Inject:
    """Make one fs I/O call fail with ``err`` for our objects while armed.

    The fs backend's file work is one call per load batch (``fs_io.read_files``)
    and one per store batch (``fs_io.publish_files``), each returning every
    file's error; compiled, so ``os`` is not involved: the error is injected
    there, as the syscall inside would give it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fn: str, err: int) -> None:
        self.real = getattr(fs_io, fn)
        self.err = err
        self.hits = 0

        def fail(path: str) -> OSError:
            self.hits += 1
            return OSError(err, os.strerror(err), path)

        # The object's path is an item's second field in a publish, its first in a read.
        at = 1 if fn == "publish_files" else 0

        def fake_batch(items: list[Any], *rest: Any) -> list[Any]:
            return [fail(it[0]) if ".kvf" in it[at] else self.real([it], *rest)[0]
                    for it in items]

        monkeypatch.setattr(fs_io, fn, fake_batch)


@pytest.mark.parametrize("fn,err", [("publish_files", errno.ENOSPC),
                                    ("publish_files", errno.EIO),
                                    ("publish_files", errno.EACCES)])
def test_store_errors(driver: Driver, monkeypatch: pytest.MonkeyPatch, fn: str, err: int) -> None:
    keys = make_keys(6, seed=3)
    rows = rows_for(keys, driver.row_bytes)
    with monkeypatch.context() as m:
        inj = _Inject(m, fn, err)
        driver.store(keys, rows, expect=False)
    driver.score.fault(f"store_{errno.errorcode[err]}", inj.hits)
    assert inj.hits >= 1 and driver.tier.counters.store_failures == 6
    driver.forget_primary()
    assert driver.fetch(keys) == [MISS] * 6  # nothing half-written became visible
    driver.store(keys, rows)  # healthy again: stored for real
    driver.forget_primary()
    assert driver.fetch(keys) == [HIT] * 6


@pytest.mark.parametrize("fn,err", [("read_files", errno.EIO), ("read_files", errno.EACCES)])
def test_load_errors(driver: Driver, monkeypatch: pytest.MonkeyPatch, fn: str, err: int) -> None:
    keys = make_keys(6, seed=4)
    driver.store(keys, rows_for(keys, driver.row_bytes))
    driver.forget_primary()
    with monkeypatch.context() as m:
        inj = _Inject(m, fn, err)
        assert driver.fetch(keys) == [MISS] * 6
    driver.score.fault(f"load_{errno.errorcode[err]}", inj.hits)
    assert inj.hits >= 1
    # A transient error does not remove the object: the next request loads it.
    assert driver.fetch(keys) == [HIT] * 6


def test_tampered_and_expiring_objects(driver: Driver) -> None:
    run_tamper_matrix(driver, seed=5)


# -- capacity on a real, small filesystem ------------------------------------------------------
TMPFS_BYTES = 32 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 32 MiB tmpfs (needs root), unmounted afterwards."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class _DiskSampler:
    """Samples a filesystem's used and free bytes every half millisecond (peak used, least free)."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path = path
        self.peak_used = 0
        self.least_free = 1 << 62
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcpproxy-disk-sampler",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            st = os.statvfs(self.path)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            self.peak_used = max(self.peak_used, used)
            self.least_free = min(self.least_free, st.f_bavail * st.f_frsize)
            self.samples += 1
            time.sleep(0.0005)

    def __enter__(self) -> _DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _store_many_blocks(d: Driver, n: int, seed: int, per_request: int = 8) -> list[bytes]:
    keys = make_keys(n, seed=seed)
    for i in range(0, n, per_request):
        batch = keys[i:i + per_request]
        d.store(batch, rows_for(batch, d.row_bytes))
    return keys


@pytest.mark.parametrize("chunk", [256 << 10, 2 << 20], ids=["256KiB", "2MiB"])
def test_max_bytes_caps_usage_on_a_small_disk(tmpfs: Path, chunk: int) -> None:
    """A 16 MiB cap on a 32 MiB tmpfs, 3x the cap stored: usage never passes the cap."""
    cap = 16 << 20
    d = Driver(BACKEND, [{"type": "fs", "root_dir": str(tmpfs), "max_bytes": cap,
                          "failure_threshold": 1000}], num_chunks=16, chunk_bytes=chunk)
    try:
        n = 3 * cap // chunk
        with _DiskSampler(tmpfs) as disk:
            keys = _store_many_blocks(d, n, seed=40 + chunk % 7)
        d.score.fault(f"cap_one_process_{chunk >> 10}KiB", n)
        failures = d.tier.counters.store_failures
        print(f"max_bytes {cap >> 10} KiB, {chunk >> 10} KiB chunks, {n} stores: peak usage "
              f"{disk.peak_used >> 10} KiB ({disk.samples} samples), {failures} store failures")
        assert disk.peak_used <= cap
        assert failures == 0
        d.forget_primary()
        tail = keys[-4:]
        assert d.fetch(tail) == [HIT] * 4  # the newest stay, byte-exact
    finally:
        assert d.close() == 0


_CAPPED_WRITER = r"""
import sys
import numpy as np
from kvstore_tiers.admin.harness import build_harness, make_keys

root = sys.argv[1]
cap, chunk, n, seed = (int(a) for a in sys.argv[2:6])
h = build_harness([{"type": "fs", "root_dir": root, "max_bytes": cap, "failure_threshold": 1000}],
                  num_chunks=16, chunk_bytes=chunk)
try:
    keys = make_keys(n, seed=seed)
    rng = np.random.default_rng(seed)
    for i in range(0, n, 8):
        h.store_all(keys[i:i + 8], rng.integers(0, 256, (8, chunk), dtype=np.uint8))
    print("store_failures", h.tiers[0].counters.store_failures, flush=True)
finally:
    h.shutdown()
"""


def test_max_bytes_holds_across_two_processes(tmpfs: Path) -> None:
    """Two engines sharing one root under a 12 MiB cap: the cap holds for their sum."""
    cap, chunk, n = 12 << 20, 256 << 10, 160
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    with _DiskSampler(tmpfs) as disk:
        procs = [subprocess.Popen([sys.executable, "-c", _CAPPED_WRITER, str(tmpfs), str(cap),
                                   str(chunk), str(n), str(seed)], stdout=subprocess.PIPE,
                                  text=True, env=env) for seed in (91, 92)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    failures = sum(int(line.split()[1]) for o in outs for line in o.splitlines()
                   if line.startswith("store_failures"))
    score(BACKEND).fault("cap_two_processes", 2 * n)
    print(f"max_bytes {cap >> 10} KiB, two processes x {n} stores of {chunk >> 10} KiB: "
          f"peak usage {disk.peak_used >> 10} KiB ({disk.samples} samples), "
          f"{failures} store failures")
    assert disk.peak_used <= cap
    assert failures == 0


class _FreeAfterWrites:
    """Wraps the fs tier's publish call: the filesystem's free bytes right after
    every batch of writes, before its reservations are given back (the least
    free space a floor must hold, seen at each write, not only when sampled)."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        self.least_free = 1 << 62
        self._publish = fs_io.publish_files
        monkeypatch.setattr(fs_io, "publish_files", self)

    def __call__(self, batch: Any, *rest: Any) -> Any:
        out = self._publish(batch, *rest)
        st = os.statvfs(self.path)
        self.least_free = min(self.least_free, st.f_bavail * st.f_frsize)
        return out


@pytest.mark.parametrize("chunk,threads,per_request", [(1 << 20, 4, 8), (256 << 10, 16, 64)],
                         ids=["1MiB-4-threads", "256KiB-16-threads"])
def test_min_free_bytes_alone_keeps_space_free(tmpfs: Path, monkeypatch: pytest.MonkeyPatch,
                                               chunk: int, threads: int,
                                               per_request: int) -> None:
    """An 8 MiB floor and no cap, 2x the disk stored by concurrent writers: at
    least 8 MiB stay free throughout, checked after every write."""
    floor = 8 << 20
    writes = _FreeAfterWrites(tmpfs, monkeypatch)
    d = Driver(BACKEND, [{"type": "fs", "root_dir": str(tmpfs), "min_free_bytes": floor,
                          "n_write_threads": threads, "failure_threshold": 1000}],
               num_chunks=2 * per_request, chunk_bytes=chunk)
    try:
        n = 2 * TMPFS_BYTES // chunk
        with _DiskSampler(tmpfs) as disk:
            keys = _store_many_blocks(d, n, seed=61, per_request=per_request)
        d.score.fault("min_free_floor", n)
        failures = d.tier.counters.store_failures
        print(f"min_free_bytes {floor >> 10} KiB, {n} stores of {chunk >> 10} KiB from "
              f"{threads} threads: least free {disk.least_free >> 10} KiB ({disk.samples} "
              f"samples), {writes.least_free >> 10} KiB after a write; {failures} store failures")
        assert disk.least_free >= floor
        assert writes.least_free >= floor
        assert failures == 0
        d.forget_primary()
        assert d.fetch(keys[-4:]) == [HIT] * 4
    finally:
        assert d.close() == 0


def test_shard_directories_count_in_max_bytes(tmp_path: Path) -> None:
    """On a disk filesystem the 4,096 shard directories take real blocks (16 MiB on ext4):
    a cap they alone exceed fails at start naming max_bytes; otherwise the whole
    namespace directory, directories included, stays under the cap."""
    from kvstore_tiers.backends.fs.capacity import scan
    from kvstore_tiers.errors import ConfigError

    probe = tmp_path / "probe"
    probe.mkdir()
    dir_bytes = probe.stat().st_blocks * 512
    if dir_bytes == 0:
        pytest.skip("directories take no blocks on this filesystem")
    root = tmp_path / "kv"
    with pytest.raises(ConfigError, match="max_bytes"):
        Driver(BACKEND, [{"type": "fs", "root_dir": str(root), "max_bytes": 4096 * dir_bytes}])
    score(BACKEND).fault("shard_dirs_over_cap")
    chunk = 64 << 10
    cap = 4200 * dir_bytes + 24 * (chunk + 4096)
    d = Driver(BACKEND, [{"type": "fs", "root_dir": str(root), "max_bytes": cap,
                          "failure_threshold": 1000}], num_chunks=16, chunk_bytes=chunk)
    try:
        _store_many_blocks(d, 96, seed=71)
        d.score.fault("shard_dirs_counted", 96)
        (ns_dir,) = [p for p in root.iterdir() if p.is_dir()]
        total, objects = scan(ns_dir)
        print(f"max_bytes {cap} with shard directories of {dir_bytes} bytes: namespace "
              f"directory {total} bytes, {len(objects)} objects")
        assert total <= cap
        assert d.tier.counters.store_failures == 0
    finally:
        assert d.close() == 0


#: The writer above, one block per line read from stdin (the test decides when each
#: starts), its keys from the seed in its fifth argument (each writes blocks of its own).
_GATED_WRITER = _WRITER.replace('    print(f"start {i}"',
                                '    sys.stdin.readline()\n    print(f"start {i}"').replace(
                                    "seed=77", "seed=int(sys.argv[5])")


def _kill_writers_mid_write(root: Path, run_config: dict[str, Any], row: int, want: int,
                            seed: int, besides: Path) -> int:
    """SIGKILL writer processes mid-write until ``want`` temp files are left
    (at most 10 rounds of 4); returns the kills. The writers of a round all
    open the tier (whose start sweeps dead writers' temp files) before any is
    killed, and each writes only when told to, so a kill lands a few
    milliseconds into a write."""
    kills = 0
    for attempt in range(10):
        if len([p for p in root.rglob("*.tmp") if p != besides]) >= want:
            break
        procs = [subprocess.Popen(
            [sys.executable, "-c", _GATED_WRITER, str(root), json.dumps(run_config), str(row),
             "400", str(1000 * seed + 10 * attempt + i)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(4)]
        for proc in procs:  # a first block each: every one is past its start
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            for line in proc.stdout:
                if line.startswith("done"):
                    break
        for i, proc in enumerate(procs):
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("start")
            time.sleep(0.002 * (1 + (seed + attempt + i) % 5))
            proc.kill()
            kills += 1
        for proc in procs:
            proc.kill()
            proc.wait()
    return kills


def test_temp_files_of_killed_writers_are_swept_and_counted(tmp_path: Path) -> None:
    """Writers SIGKILLed mid-write leave temp files: gc and a tier's start remove
    them, never the temp file of a live writer, and the capacity count includes
    the temp files it keeps."""
    from kvstore_tiers import admin
    from kvstore_tiers.backends.fs.capacity import scan
    from kvstore_tiers.backends.fs.writers import WriterLock, WriterTable

    row = 32 << 20  # a write of ~30 ms: the kills land inside one
    root = tmp_path / "kv"
    tier = {"type": "fs", "root_dir": str(root)}
    d = Driver(BACKEND, [tier], num_chunks=4, chunk_bytes=1 << 20)
    run_config = dict(d.tier.namespace.run_config)
    base = d.tier.backend.base
    assert d.close() == 0

    # A live writer's temp file (another engine mid-write): never swept.
    live = WriterLock(base)
    live_tmp = Path(live.temp_name(str(base / "abc" / "live.kvf")))
    live_tmp.write_bytes(b"x" * 8192)
    try:
        kills = _kill_writers_mid_write(root, run_config, row, want=3, seed=1,
                                        besides=live_tmp)
        left = [p for p in root.rglob("*.tmp") if p != live_tmp]
        print(f"{kills} writers killed mid-write left {len(left)} temp files "
              f"({sum(p.stat().st_blocks * 512 for p in left) >> 10} KiB)")
        assert left, "no writer was killed mid-write"
        # Counted (not swept: no table) by the capacity count, like every other block.
        total, _objects = scan(base)
        assert total >= sum(p.stat().st_blocks * 512 for p in left)
        score(BACKEND).fault("temp_files_of_killed_writers_gc", len(left))
        admin.gc(tier, max_age_s=10 * 365 * 86400.0)  # removes no object: only the sweep
        assert not [p for p in root.rglob("*.tmp") if p != live_tmp]
        assert live_tmp.exists()

        kills = _kill_writers_mid_write(root, run_config, row, want=2, seed=2,
                                        besides=live_tmp)
        left = [p for p in root.rglob("*.tmp") if p != live_tmp]
        assert left
        score(BACKEND).fault("temp_files_of_killed_writers_start", len(left))
        d = Driver(BACKEND, [tier], num_chunks=4, chunk_bytes=1 << 20)
        try:
            print(f"a fresh tier removed {d.tier.backend.swept_temp_files} temp files")
            assert d.tier.backend.swept_temp_files == len(left)
            assert not [p for p in root.rglob("*.tmp") if p != live_tmp]
            assert live_tmp.exists()
        finally:
            assert d.close() == 0

        # The capacity count keeps and counts the live writer's temp file, and
        # removes a dead one's.
        kills = _kill_writers_mid_write(root, run_config, row, want=1, seed=3,
                                        besides=live_tmp)
        left = [p for p in root.rglob("*.tmp") if p != live_tmp]
        table = WriterTable(base)
        try:
            total, objects = scan(base, table)
        finally:
            table.close()
        assert left and table.swept_files == len(left) and live_tmp.exists()
        score(BACKEND).fault("temp_files_of_killed_writers_count", len(left))
        assert total >= live_tmp.stat().st_blocks * 512 + sum(o[1] for o in objects)
    finally:
        live.close()
        live_tmp.unlink()
