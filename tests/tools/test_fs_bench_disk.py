"""The bench's disk probe on a filesystem that refuses O_DIRECT."""

from __future__ import annotations

import errno
import os

import pytest

from kvstore_tiers.backends.fs import O_DIRECT
from kvstore_tiers.tools.bench.fs_bench import disk_o_direct


def test_the_disk_probe_measures_buffered_io_where_o_direct_is_refused(
    tmp_path, monkeypatch
) -> None:
    # overlayfs (a container's root) and NFS answer EINVAL to O_DIRECT; none
    # can be mounted on demand here, so that answer is injected.
    real_open = os.open

    def refuse_o_direct(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_o_direct)
    disk = disk_o_direct(tmp_path, 64 * 1024, 1 << 20, threads=2)
    assert disk["write_gbps"] > 0 and disk["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # probe files removed


def test_a_failing_disk_probe_raises_instead_of_reporting_a_speed(tmp_path, monkeypatch) -> None:
    def eio(fd, buffers):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "readv", eio)  # an I/O error no healthy disk gives on demand
    with pytest.raises(OSError, match="Input/output error"):
        disk_o_direct(tmp_path, 64 * 1024, 1 << 20, threads=2)
    assert list(tmp_path.iterdir()) == []
