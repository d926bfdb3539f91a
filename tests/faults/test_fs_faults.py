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

from kvstore_tiers.backends.fs import fileio as fs_io
from kvstore_tiers.harness import make_keys

from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix

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
from kvstore_tiers.backends.base import StoreItem
from kvstore_tiers.codecs import CodecId
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.harness import make_keys
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
    (res,) = be.store_many([StoreItem(ns.object_name(k), k, memoryview(row))], codec)
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

        def fake_batch(items: list[Any]) -> list[Any]:
            return [fail(it[0]) if ".kvf" in it[at] else self.real([it])[0] for it in items]

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
