"""The fs tier's per-block file calls (kvstore_tiers.backends.fs.fileio): the
compiled ``_fsio`` pair and the pure-Python pair must behave the same, byte
for byte and error for error."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore_tiers.backends import fs
from kvstore_tiers.backends.fs import fileio

PAGE = mmap.PAGESIZE


def _single(read_files):
    """One file through a batch read, its error raised: the per-file contract."""
    def read_file(path, buffers, flags):
        (res,) = read_files([(path, buffers, flags)])
        if isinstance(res, OSError):
            raise res
        return res

    return read_file


def _native() -> SimpleNamespace:
    from kvstore_tiers.backends.fs import _fsio

    return SimpleNamespace(read_file=_single(_fsio.read_files), publish_file=_fsio.publish_file,
                           publish_files=_fsio.publish_files, exists_files=_fsio.exists_files,
                           read_files=_fsio.read_files)


@pytest.fixture(params=["native", "python"])
def io(request) -> SimpleNamespace:
    if request.param == "native":
        return _native()
    return SimpleNamespace(read_file=_single(fileio.read_files_py),
                           publish_file=fileio.publish_file_py,
                           publish_files=fileio.publish_files_py,
                           exists_files=fileio.exists_files_py, read_files=fileio.read_files_py)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """RLIMIT_FSIZE makes the kernel cut a write short (and refuse the next
    with EFBIG): a real short write, the way a full disk produces one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_the_native_calls_are_built_and_used() -> None:
    # setup.py compiles them wherever a C compiler exists, and the dev venv is
    # built on one; without them the fs tier quietly takes the Python path,
    # which is not what the benchmarks describe.
    native = _native()
    if os.environ.get("KVSTORE_TIERS_FS_NATIVE", "1") != "0":
        assert fileio.NATIVE
        assert fileio.publish_file is native.publish_file
        assert fileio.publish_files is native.publish_files
        assert fileio.exists_files is native.exists_files
        assert fileio.read_files is native.read_files


# -- read_files --------------------------------------------------------------------
def test_read_files_gives_each_file_its_own_outcome_in_order(io, tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"A" * 10)
    (tmp_path / "b").write_bytes(b"B" * 100)
    (tmp_path / "d").mkdir()
    bufs = [[bytearray(4), bytearray(20)], [bytearray(3)], [bytearray(8), bytearray(100)],
            [bytearray(5)]]
    paths = [tmp_path / "a", tmp_path / "missing", tmp_path / "b", tmp_path / "d"]
    before = _open_fds()
    out = io.read_files([(str(p), b, 0) for p, b in zip(paths, bufs, strict=True)])
    assert _open_fds() == before
    assert out[0] == (10, 10) and bytes(bufs[0][0]) == b"AAAA" and bufs[0][1][:6] == b"A" * 6
    # A miss or a directory fails that file only, named, as read_file raises it.
    assert isinstance(out[1], FileNotFoundError) and out[1].filename == str(paths[1])
    assert out[2] == (100, 100) and bytes(bufs[2][0]) + bufs[2][1][:92] == b"B" * 100
    assert isinstance(out[3], IsADirectoryError) and out[3].errno == errno.EISDIR
    # A file that fills its buffers reports its real size.
    assert io.read_files([(str(paths[2]), [bytearray(10)], 0)]) == [(10, 100)]
    assert io.read_files([]) == []


def test_read_files_on_threads_gives_what_one_thread_gives(io, tmp_path: Path) -> None:
    """``threads`` changes only how many files are read at once: every
    outcome, byte and checksum is the one-thread call's, in item order."""
    rng = __import__("random").Random(7)
    items, bufs = [], []
    for i in range(40):
        size = rng.choice([0, 1, PAGE - 1, PAGE, 3 * PAGE + 5, 70_000])
        if i % 9 != 4:  # every ninth is missing
            (tmp_path / f"{i}").write_bytes(os.urandom(size))
        bufs.append([[bytearray(PAGE), bytearray(2 * PAGE), bytearray(PAGE)] for _ in "ab"])
    items = [[(str(tmp_path / f"{i}"), b[k], 0, 1) for i, b in enumerate(bufs)] for k in (0, 1)]
    one, many = io.read_files(items[0], 1), io.read_files(items[1], 8)
    assert [repr(r) for r in one] == [repr(r) for r in many]
    assert sum(isinstance(r, FileNotFoundError) for r in many) == 4
    assert all(bytes(x) == bytes(y) for b in bufs for x, y in zip(*b, strict=True))


def test_read_files_reads_a_batch_on_several_threads_at_once(tmp_path: Path) -> None:
    """With ``threads=2`` the second file is opened while the first still
    waits: two FIFOs whose writer serves the second first. Read one after
    the other, the first's open would block until the writer gives up."""
    from kvstore_tiers.backends.fs import _fsio

    a, b = tmp_path / "a", tmp_path / "b"
    os.mkfifo(a)
    os.mkfifo(b)
    served: list[str] = []

    def writer() -> None:
        for _ in range(2000):  # up to 10 s for the reader to open b
            try:
                fd = os.open(b, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader yet
            except OSError:
                threading.Event().wait(0.005)
                continue
            os.write(fd, b"second")
            os.close(fd)
            served.append("b")
            break
        with open(a, "wb") as f:  # unblocks a sequential reader after the wait too
            f.write(b"first")
        served.append("a")

    t = threading.Thread(target=writer)
    t.start()
    bufs = [bytearray(16), bytearray(16)]
    out = _fsio.read_files([(str(a), [bufs[0]], 0), (str(b), [bufs[1]], 0)], 2)
    t.join()
    assert served == ["b", "a"]
    assert out == [(5, 5), (6, 6)] and bufs[0][:5] == b"first" and bufs[1][:6] == b"second"
    with pytest.raises(ValueError, match="threads"):
        _fsio.read_files([], 0)
    # More threads than a call has files (n_read_threads goes to 256): as many as it can use.
    (tmp_path / "c").write_bytes(b"abc")
    assert _fsio.read_files([(str(tmp_path / "c"), [bytearray(4)], 0)], 256) == [(3, 3)]


def _helpers() -> set[str]:
    """The thread ids of read_files' helpers in this process."""
    tasks = Path("/proc/self/task")
    return {t.name for t in tasks.iterdir()
            if (t / "comm").read_text().strip() == "kvstore-fsio"}


def test_read_files_keeps_its_helper_threads_across_calls(tmp_path: Path) -> None:
    """The helpers a call needs are started once and kept: later calls,
    also from several Python threads at once, reuse them (at most 64 in
    all), and a call returns only once no helper still reads its items."""
    from kvstore_tiers.backends.fs import _fsio

    paths = []
    for i in range(16):
        (tmp_path / f"{i}").write_bytes(bytes([i]) * 5000)
        paths.append(str(tmp_path / f"{i}"))

    def call(threads: int) -> None:
        bufs = [bytearray(8192) for _ in paths]
        out = _fsio.read_files([(p, [b], 0) for p, b in zip(paths, bufs, strict=True)],
                               threads)
        assert out == [(5000, 5000)] * 16
        assert all(b[:5000] == bytes([i]) * 5000 for i, b in enumerate(bufs))

    call(8)
    kept = _helpers()
    assert len(kept) >= 7  # the other 7 of 8 threads, still there
    for tid in kept:  # signals for the process go to a thread that runs Python
        status = (Path("/proc/self/task") / tid / "status").read_text()
        blocked = int(next(ln for ln in status.splitlines() if ln.startswith("SigBlk:"))
                      .split()[1], 16)
        assert all(blocked >> (sig - 1) & 1 for sig in (signal.SIGINT, signal.SIGTERM))
    for _ in range(200):
        call(8)
    assert _helpers() == kept  # the same threads: none started, none left
    callers = [threading.Thread(target=lambda: [call(8) for _ in range(50)]) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    grown = _helpers()
    assert kept <= grown and len(grown) <= 64
    for _ in range(50):
        call(8)
    assert _helpers() == grown


def test_read_files_on_threads_works_in_a_forked_child(tmp_path: Path) -> None:
    """A child forked while the parent's helpers wait has none of them (a
    fork copies only the calling thread): its calls start their own."""
    from kvstore_tiers.backends.fs import _fsio

    for i in range(8):
        (tmp_path / f"{i}").write_bytes(b"x" * (i + 1))
    items = [(str(tmp_path / f"{i}"), [bytearray(16)], 0) for i in range(8)]
    assert _fsio.read_files(items, 8) == [(i + 1, i + 1) for i in range(8)]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        signal.alarm(20)  # a deadlocked child fails the test rather than hanging it
        ok = _fsio.read_files(items, 8) == [(i + 1, i + 1) for i in range(8)]
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _fsio.read_files(items, 8) == [(i + 1, i + 1) for i in range(8)]


def test_read_files_refuses_a_bad_batch_before_reading_any_of_it(io, tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"new")
    first = bytearray(b"old")
    with pytest.raises((TypeError, BufferError)):
        io.read_files([(str(tmp_path / "a"), [first], 0), (str(tmp_path / "a"), [b"ro"], 0)])
    assert first == b"old"
    with pytest.raises(ValueError):
        io.read_files([(str(tmp_path / "a"), [bytearray(3)], 0)] * 65)


def test_read_files_o_direct_into_aligned_pages(io, tmp_path: Path) -> None:
    if not fs.probe_o_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT on this filesystem")
    data = [os.urandom(2 * PAGE), os.urandom(PAGE)]
    for i, d in enumerate(data):
        (tmp_path / f"{i}").write_bytes(d)
    bufs = [mmap.mmap(-1, 3 * PAGE) for _ in data]
    out = io.read_files([(str(tmp_path / f"{i}"), [memoryview(b)], fs.O_DIRECT)
                         for i, b in enumerate(bufs)])
    assert out == [(2 * PAGE, 2 * PAGE), (PAGE, PAGE)]
    assert [bytes(b[: len(d)]) for b, d in zip(bufs, data, strict=True)] == data


def test_read_files_checksums_the_buffer_it_was_asked_for_once_filled(tmp_path: Path) -> None:
    """crc_of: the CRC-32C of that buffer, equal to the crc32c package's (the
    frame's checksum) at every length and alignment, None where the read
    stopped short of the buffer's end; the Python twin leaves it to the caller."""
    crc32c = pytest.importorskip("crc32c")
    from kvstore_tiers.backends.fs import _fsio

    if not _fsio.CRC32C_INSN:
        pytest.skip("no CRC-32C instruction on this CPU: the frame checksums instead")
    for piece in (0, fileio.CRC_PIECE, 1000):
        _check_read_checksums(tmp_path, crc32c.crc32c, _fsio, piece)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    rows = [bytearray(10), bytearray(200)]
    assert _fsio.read_files([(str(path), rows, 0, 0), (str(path), rows, 0, 1),
                             (str(path), rows, 0)]) == [
        (100, 100, crc32c.crc32c(b"x" * 10)), (100, 100, None), (100, 100)]
    assert fileio.read_files_py([(str(path), [bytearray(10)], 0, 0)]) == [(10, 100, None)]


def _check_read_checksums(tmp_path: Path, crc: Callable[[bytes], int], _fsio: Any,
                          piece: int) -> None:
    """With ``piece`` (0: whole reads), every length around the CRC's
    boundaries -- 8-byte words, the streams' 3 x 8 KiB, the fold's 256-byte
    steps, the 256 KiB pieces a read in memory checksums as they land -- at
    several alignments, with a header buffer before the row and an overflow
    buffer after it that the file fills partly or not at all; and files that
    end inside the header or the row."""
    path = tmp_path / "f"
    span3, p = 3 * 8192, fileio.CRC_PIECE
    lengths = (0, 1, 7, 8, 9, 63, 255, 256, 257, 4096, span3 - 1, span3, span3 + 1,
               2 * span3 + 9, 100_003, p - 1, p, p + 1, 2 * p + 256 + 5, 2 << 20)
    for n in lengths:
        for skip in (0, 1, 3, 8):
            for extra in (0, 5):  # the file's bytes past the row
                data = os.urandom(skip + n + extra)
                path.write_bytes(data)
                body = memoryview(bytearray(n + skip))[skip:]  # the row at another alignment too
                bufs = ([bytearray(skip)] if skip else []) + [body, bytearray(64)]
                (res,) = _fsio.read_files([(str(path), bufs, 0, len(bufs) - 2)], 1, piece)
                assert res == (len(data), len(data), crc(data[skip:skip + n])), (n, skip, extra)
                assert bytes(body) == data[skip:skip + n]
    # The file ends in the header or in the row behind it, which is one piece
    # (300 bytes) or several.
    for head, n in ((0, 300), (4096, 300), (0, 2 << 20), (4096, 2 << 20)):
        for cut in (0, 1, 100, head + 1, head + p - 1, head + p, head + p + 3, head + n - 3,
                    head + n - 1):
            if cut >= head + n:
                continue
            path.write_bytes(os.urandom(cut))
            bufs = ([bytearray(head)] if head else []) + [bytearray(n), bytearray(64)]
            (res,) = _fsio.read_files([(str(path), bufs, 0, len(bufs) - 2)], 1, piece)
            assert res == (cut, cut, None), (head, cut)


def test_reads_and_publishes_checksum_the_same_without_folding(tmp_path: Path) -> None:
    """KVSTORE_TIERS_FS_CRC_FOLD=0: the three streams and one whole read (or
    one writev after the checksum), as on a CPU without VPCLMULQDQ, give the
    same answers."""
    pytest.importorskip("crc32c")
    from kvstore_tiers.backends.fs import _fsio

    if not _fsio.CRC32C_INSN:
        pytest.skip("no CRC-32C instruction on this CPU: the frame checksums instead")
    code = (
        "import sys, pathlib, crc32c\n"
        "from kvstore_tiers.backends.fs import _fsio\n"
        "from tests.backends.fs.test_fs_io import _check_read_checksums\n"
        "assert _fsio.CRC32C_INSN and not _fsio.CRC32C_FOLD\n"
        "from tests.backends.fs.test_fs_io import _check_publish_checksums\n"
        "_check_read_checksums(pathlib.Path(sys.argv[1]), crc32c.crc32c, _fsio, 256 * 1024)\n"
        "_check_publish_checksums(pathlib.Path(sys.argv[1]), crc32c.crc32c,"
        " _fsio.publish_files, 256 * 1024)\n")
    env = {**os.environ, "KVSTORE_TIERS_FS_CRC_FOLD": "0"}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                         cwd=Path(__file__).parents[3], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo")
def test_the_crc_folds_wherever_the_cpu_can() -> None:
    """CRC32C_FOLD is set exactly where the CPU has AVX-512 and VPCLMULQDQ
    (x86-64), so a machine that could fold is not silently testing the
    three streams alone."""
    from kvstore_tiers.backends.fs import _fsio

    if os.environ.get("KVSTORE_TIERS_FS_CRC_FOLD") == "0":
        pytest.skip("folding turned off by KVSTORE_TIERS_FS_CRC_FOLD=0")
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    can = os.uname().machine == "x86_64" and {"avx512f", "vpclmulqdq", "pclmulqdq",
                                             "sse4_2"} <= flags
    assert bool(_fsio.CRC32C_FOLD) == can


def test_read_files_refuses_a_crc_of_past_the_buffers(io, tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    first = bytearray(3)
    with pytest.raises(ValueError):
        io.read_files([(str(tmp_path / "a"), [first], 0), (str(tmp_path / "a"), [first], 0, 1)])
    assert first == bytearray(3)


# -- exists_files ------------------------------------------------------------------
def test_exists_files_answers_each_path_in_order(io, tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(b"x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "link").symlink_to(tmp_path / "obj")
    paths = [tmp_path / "obj", tmp_path / "missing", tmp_path / "no_dir" / "obj",
             tmp_path / "dangling", tmp_path / "link", tmp_path / "obj", tmp_path / "ünï"]
    # What os.path.exists says, path by path: a dangling link is absent.
    assert io.exists_files([str(p) for p in paths]) == [True, False, False, False, True, True,
                                                        False]
    assert io.exists_files([]) == []


def test_exists_files_takes_a_lookup_batch_in_one_call(io, tmp_path: Path) -> None:
    names = [str(tmp_path / f"{i:04d}") for i in range(1000)]
    for n in names[::3]:
        Path(n).touch()
    assert io.exists_files(names) == [i % 3 == 0 for i in range(1000)]


# -- one file through read_files (the per-file contract) ----------------------
def test_a_short_file_fills_the_buffers_in_order_and_its_length_is_the_size(
    io, tmp_path: Path
) -> None:
    data = os.urandom(PAGE + 5000)
    path = tmp_path / "f"
    path.write_bytes(data)
    a, b, c = bytearray(PAGE), bytearray(4096), bytearray(PAGE)
    n, size = io.read_file(str(path), [a, b, c], 0)
    assert (n, size) == (len(data), len(data))
    assert bytes(a) == data[:PAGE] and bytes(b) == data[PAGE:PAGE + 4096]
    assert bytes(c[:904]) == data[PAGE + 4096:]


def test_a_file_that_fills_the_buffers_reports_its_real_size(io, tmp_path: Path) -> None:
    data = os.urandom(3 * PAGE + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    a, b = bytearray(PAGE), memoryview(bytearray(PAGE))
    assert io.read_file(str(path), [a, b], 0) == (2 * PAGE, len(data))
    assert bytes(a) + bytes(b) == data[: 2 * PAGE]


def test_an_empty_file_reads_nothing(io, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert io.read_file(str(path), [bytearray(PAGE)], 0) == (0, 0)


@pytest.mark.parametrize(("make", "exc", "code"), [
    (lambda p: None, FileNotFoundError, errno.ENOENT),
    (lambda p: p.mkdir(), IsADirectoryError, errno.EISDIR),
])
def test_read_errors_are_oserrors_naming_the_path_and_leak_no_descriptor(
    io, tmp_path: Path, make, exc, code
) -> None:
    path = tmp_path / "x"
    make(path)
    before = _open_fds()
    with pytest.raises(exc) as info:
        io.read_file(str(path), [bytearray(PAGE)], 0)
    assert info.value.errno == code and info.value.filename == str(path)
    assert _open_fds() == before


def test_a_read_only_buffer_is_refused_and_leaks_no_descriptor(io, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    before = _open_fds()
    with pytest.raises((TypeError, BufferError)):
        io.read_file(str(path), [bytearray(10), b"read-only"], 0)
    assert _open_fds() == before


def test_non_ascii_paths(io, tmp_path: Path) -> None:
    path = tmp_path / "blöck-κ.kvf"
    io.publish_file(str(tmp_path / "t.tmp"), str(path), [b"abc"], 0)
    buf = bytearray(8)
    assert io.read_file(str(path), [buf], 0) == (3, 3) and buf[:3] == b"abc"


def test_o_direct_round_trip_through_aligned_pages(io, tmp_path: Path) -> None:
    if not fs.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    pages = memoryview(mmap.mmap(-1, 4 * PAGE))
    try:
        data = os.urandom(2 * PAGE)
        pages[: 2 * PAGE] = data
        path = str(tmp_path / "f")
        assert io.publish_file(path + ".tmp", path, [pages[:PAGE], pages[PAGE:2 * PAGE]],
                               fs.O_DIRECT) == 2 * PAGE
        assert io.read_file(path, [pages[2 * PAGE:3 * PAGE], pages[3 * PAGE:]],
                            fs.O_DIRECT) == (2 * PAGE, 2 * PAGE)
        assert bytes(pages[2 * PAGE:]) == data
    finally:
        pages.release()


def test_the_gil_is_free_while_the_file_is_opened_and_read(io, tmp_path: Path) -> None:
    # Opening a FIFO blocks until a writer opens it. The writer is this
    # (Python) thread, so the read can only finish if it let go of the GIL.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    buf = bytearray(64)
    result: list[tuple[int, int]] = []
    reader = threading.Thread(target=lambda: result.append(io.read_file(str(fifo), [buf], 0)))
    reader.start()
    fd = os.open(fifo, os.O_WRONLY)  # blocks until the reader's open
    os.write(fd, b"hello")
    os.close(fd)
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert result[0][0] == 5 and buf[:5] == b"hello"


# -- publish_file ----------------------------------------------------------------
def test_publish_writes_the_parts_in_order_and_leaves_no_temp_file(io, tmp_path: Path) -> None:
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.kvf.x.tmp"
    parts = [os.urandom(100), memoryview(os.urandom(PAGE)), bytearray(b"tail")]
    assert io.publish_file(str(tmp), str(path), parts, 0) == 100 + PAGE + 4
    assert path.read_bytes() == b"".join(bytes(p) for p in parts)
    assert not tmp.exists() and (path.stat().st_mode & 0o777) == 0o644


def test_publish_over_an_existing_object_writes_nothing(io, tmp_path: Path) -> None:
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.tmp"
    path.write_bytes(b"first")
    assert io.publish_file(str(tmp), str(path), [b"second"], 0) == 0
    assert path.read_bytes() == b"first" and not tmp.exists()


def test_publish_into_a_missing_directory_names_the_temp_file(io, tmp_path: Path) -> None:
    path, tmp = tmp_path / "gone" / "obj.kvf", tmp_path / "gone" / "obj.tmp"
    with pytest.raises(FileNotFoundError) as info:
        io.publish_file(str(tmp), str(path), [b"x"], 0)
    assert info.value.filename == str(tmp)


def test_a_failed_rename_removes_the_temp_file_and_names_the_target(
    io, tmp_path: Path
) -> None:
    # The temp file is created, the rename fails: the target's directory is missing.
    path, tmp = tmp_path / "missing" / "obj.kvf", tmp_path / "obj.tmp"
    before = _open_fds()
    with pytest.raises(FileNotFoundError) as info:
        io.publish_file(str(tmp), str(path), [b"payload"], 0)
    assert info.value.filename == str(path)
    assert not tmp.exists() and _open_fds() == before


def test_a_short_write_is_eio_and_leaves_nothing_behind(io, tmp_path: Path) -> None:
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.tmp"
    with _file_size_limit(PAGE), pytest.raises(OSError) as info:
        io.publish_file(str(tmp), str(path), [bytes(PAGE), bytes(PAGE)], 0)
    assert info.value.errno in (errno.EIO, errno.EFBIG)
    assert not path.exists() and not tmp.exists()


def test_publish_refuses_a_non_buffer_and_creates_nothing(io, tmp_path: Path) -> None:
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.tmp"
    with pytest.raises(TypeError):
        io.publish_file(str(tmp), str(path), [b"ok", 42], 0)
    assert list(tmp_path.iterdir()) == []


# -- publish_files ---------------------------------------------------------------
def test_publish_files_gives_each_file_its_own_outcome_in_order(io, tmp_path: Path) -> None:
    # A store batch: one file fails (its directory is gone), one existed; the
    # others are written all the same, and the failure names its temp file.
    (tmp_path / "old.kvf").write_bytes(b"first")
    data = [os.urandom(PAGE + i) for i in range(3)]
    items = [
        (str(tmp_path / "a.tmp"), str(tmp_path / "a.kvf"), [data[0][:PAGE], data[0][PAGE:]], 0),
        (str(tmp_path / "gone" / "b.tmp"), str(tmp_path / "gone" / "b.kvf"), [data[1]], 0),
        (str(tmp_path / "o.tmp"), str(tmp_path / "old.kvf"), [b"second"], 0),
        (str(tmp_path / "c.tmp"), str(tmp_path / "c.kvf"), [memoryview(data[2])], 0),
    ]
    before = _open_fds()
    out = io.publish_files(items)
    assert out[0] == len(data[0]) and out[2] == 0 and out[3] == len(data[2])
    assert isinstance(out[1], FileNotFoundError) and out[1].filename == items[1][0]
    assert (tmp_path / "a.kvf").read_bytes() == data[0]
    assert (tmp_path / "c.kvf").read_bytes() == data[2]
    assert (tmp_path / "old.kvf").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kvf", "c.kvf", "old.kvf"]
    assert _open_fds() == before
    assert io.publish_files([]) == []


def test_publish_files_a_short_write_fails_that_file_only(io, tmp_path: Path) -> None:
    small, big = tmp_path / "small.kvf", tmp_path / "big.kvf"
    with _file_size_limit(PAGE):
        out = io.publish_files([
            (str(tmp_path / "b.tmp"), str(big), [bytes(PAGE), bytes(PAGE)], 0),
            (str(tmp_path / "s.tmp"), str(small), [b"fits"], 0),
        ])
    assert isinstance(out[0], OSError) and out[0].errno in (errno.EIO, errno.EFBIG)
    assert out[1] == 4 and small.read_bytes() == b"fits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.kvf"]


def test_publish_files_refuses_a_bad_batch_before_writing_any_of_it(
    io, tmp_path: Path
) -> None:
    good = (str(tmp_path / "a.tmp"), str(tmp_path / "a.kvf"), [b"ok"], 0)
    with pytest.raises(TypeError):
        io.publish_files([good, (str(tmp_path / "b.tmp"), str(tmp_path / "b.kvf"), [42], 0)])
    with pytest.raises(ValueError):
        io.publish_files([good] * 65)
    assert list(tmp_path.iterdir()) == []


def _check_publish_checksums(tmp_path: Path, crc: Callable[[bytes], int],
                             publish_files: Callable[..., list[Any]], piece: int) -> None:
    """(crc_of, crc_at): the file holds the header with the CRC-32C of buffer
    crc_of put little-endian at crc_at, then every buffer as given, for every
    length around the CRC's boundaries and the pieces, a header of a frame's
    64 bytes or a page, and a buffer after the row; the caller's header is
    not changed."""
    span3, p = 3 * 8192, fileio.CRC_PIECE
    lengths = (0, 1, 7, 9, 255, 256, 257, 4096, 4352, span3 + 1, p - 1, p, p + 1,
               2 * p + 256 + 5, 2 << 20)
    tmp_path = tmp_path / "publish"
    tmp_path.mkdir(exist_ok=True)
    for n in lengths:
        for head, at, mid, tail in ((64, 32, b"", b""), (PAGE, 32, b"", b""),
                                    (PAGE, PAGE - 4, b"", b"tail"), (64, 0, b"mid", b"t")):
            header, row = os.urandom(head), os.urandom(n)
            parts = [header, *([mid] if mid else []), memoryview(bytearray(row)),
                     *([tail] if tail else [])]
            path, tmp = tmp_path / "f.kvf", tmp_path / "f.tmp"
            (res,) = publish_files([(str(tmp), str(path), parts, 0, 2 if mid else 1, at)], piece)
            assert res == head + len(mid) + n + len(tail), (n, head, res)
            want = bytearray(header)
            want[at:at + 4] = crc(row).to_bytes(4, "little")
            assert path.read_bytes() == bytes(want) + mid + row + tail, (n, head, at, piece)
            assert parts[0] == header
            path.unlink()
            assert list(tmp_path.iterdir()) == []


def _publish_crc_or_skip(io: SimpleNamespace) -> None:
    if io.publish_files is not fileio.publish_files_py and not fileio.PUBLISH_CRC:
        pytest.skip("no CRC-32C instruction on this CPU: the frame checksums before publishing")


def test_publish_files_checksums_a_buffer_into_the_first(io, tmp_path: Path) -> None:
    """A store's frame: the publish checksums the row as it writes it (a
    piece at a time where the CRC folds), into the header's checksum field."""
    crc32c = pytest.importorskip("crc32c")
    _publish_crc_or_skip(io)
    for piece in (0, fileio.CRC_PIECE, 1000):
        _check_publish_checksums(tmp_path, crc32c.crc32c, io.publish_files, piece)
    # publish_file takes the same two fields; an existing object is not rewritten.
    path = tmp_path / "one.kvf"
    assert io.publish_file(str(tmp_path / "one.tmp"), str(path), [bytes(8), b"row"], 0,
                           1, 2) == 11
    assert path.read_bytes() == bytes(2) + crc32c.crc32c(b"row").to_bytes(4, "little") + \
        bytes(2) + b"row"
    assert io.publish_files([(str(tmp_path / "two.tmp"), str(path), [bytes(8), b"x"], 0,
                              1, 0)], 1000) == [0]


def test_publish_files_checksums_o_direct_writes_from_aligned_pages(tmp_path: Path) -> None:
    """O_DIRECT: the checksum first, then one write of the aligned copy of
    the header and the row (no pieces: the device's request stays whole)."""
    crc32c = pytest.importorskip("crc32c")
    if not fileio.NATIVE or not fileio.probe_o_direct(str(tmp_path)):
        pytest.skip("needs the compiled calls and O_DIRECT here")
    pages = mmap.mmap(-1, 3 * PAGE)
    pages[:] = os.urandom(3 * PAGE)
    view = memoryview(pages)
    path = tmp_path / "d.kvf"
    items = [(str(tmp_path / "d.tmp"), str(path), [view[:PAGE], view[PAGE:]], fileio.O_DIRECT,
              1, 32)]
    assert fileio.publish_files(items, fileio.CRC_PIECE) == [3 * PAGE]
    want = bytearray(pages[:])
    want[32:36] = crc32c.crc32c(pages[PAGE:]).to_bytes(4, "little")
    assert path.read_bytes() == bytes(want)


@pytest.mark.parametrize("piece", [0, 1000])
def test_a_checksummed_publish_that_cannot_grow_the_file_leaves_nothing(
    io, tmp_path: Path, piece: int
) -> None:
    # The row is written before the header where the CRC folds: its error,
    # the file-size limit's EFBIG, is reported all the same.
    _publish_crc_or_skip(io)
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.tmp"
    with _file_size_limit(PAGE):
        (res,) = io.publish_files([(str(tmp), str(path), [bytes(PAGE), bytes(PAGE)], 0, 1, 32)],
                                  piece)
    assert isinstance(res, OSError) and res.errno in (errno.EIO, errno.EFBIG)
    assert list(tmp_path.iterdir()) == []


def test_a_checksummed_publish_that_fills_the_disk_midway_leaves_nothing(
    io, tmp_path: Path
) -> None:
    # A full tmpfs part-way through the row's pieces: ENOSPC for that item,
    # no temp file, and the next item (one that fits) is written whole.
    _publish_crc_or_skip(io)
    with _tmpfs(tmp_path / "small", 256 << 10) as disk:
        big, small = os.urandom(1 << 20), os.urandom(100)
        out = io.publish_files([
            (str(disk / "b.tmp"), str(disk / "b.kvf"), [bytes(PAGE), big], 0, 1, 32),
            (str(disk / "s.tmp"), str(disk / "s.kvf"), [bytes(PAGE), small], 0, 1, 32)], 1000)
        assert isinstance(out[0], OSError) and out[0].errno == errno.ENOSPC
        assert out[1] == PAGE + 100 and sorted(p.name for p in disk.iterdir()) == ["s.kvf"]


def _shmem_huge_pages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) << 10
    return 0


def test_a_piece_wise_publish_keeps_a_huge_page_tmpfs_in_huge_pages(tmp_path: Path) -> None:
    """On a tmpfs mounted huge=within_size, files written piece by piece (the
    header last) get huge pages as one write would: the file is sized first."""
    policy = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if not fileio.NATIVE or not fileio.PUBLISH_CRC or not policy.exists() or \
            "[deny]" in policy.read_text():
        pytest.skip("needs the compiled calls with checksums and tmpfs huge pages")
    disk = tmp_path / "huge"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=within_size", "tmpfs",
                        str(disk)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        row = os.urandom(4 << 20)
        before = _shmem_huge_pages()
        for i in range(4):
            assert fileio.publish_files([(str(disk / f"{i}.tmp"), str(disk / f"{i}.kvf"),
                                          [bytes(PAGE), row], 0, 1, 32)], fileio.CRC_PIECE) \
                == [PAGE + len(row)]
        # Each file's first two 2 MiB ranges lie inside it (its last page does not).
        assert _shmem_huge_pages() - before >= 4 * (4 << 20) * 3 // 4
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


def test_publish_files_refuses_a_checksum_outside_the_buffers(io, tmp_path: Path) -> None:
    good = (str(tmp_path / "a.tmp"), str(tmp_path / "a.kvf"), [bytes(64), b"row"], 0, 1, 32)
    for crc_of, crc_at in ((0, 32), (2, 32), (1, 61), (1, -1)):
        bad = (str(tmp_path / "b.tmp"), str(tmp_path / "b.kvf"), [bytes(64), b"row"], 0,
               crc_of, crc_at)
        with pytest.raises(ValueError):
            io.publish_files([good, bad])
    assert list(tmp_path.iterdir()) == []


# -- what a store reports (issue: lost publish races, full disks) --------------------
def test_a_short_write_reports_the_kernels_reason_not_eio(io, tmp_path: Path) -> None:
    """A short write is followed by a write of the rest, whose error says why
    the file could not grow (here the file-size limit: EFBIG; a full disk: ENOSPC)."""
    path, tmp = tmp_path / "obj.kvf", tmp_path / "obj.tmp"
    with _file_size_limit(PAGE), pytest.raises(OSError) as info:
        io.publish_file(str(tmp), str(path), [bytes(PAGE // 2), bytes(PAGE)], 0)
    assert info.value.errno == errno.EFBIG and info.value.filename == str(tmp)
    assert not path.exists() and not tmp.exists()


@contextlib.contextmanager
def _tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A real, small tmpfs at ``path`` (skips where mounting is not allowed)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_a_full_disk_is_no_space_left_not_an_io_error(io, tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "small", 256 << 10) as disk:
        payload = os.urandom(48 << 10)
        errors = []
        for i in range(12):
            try:
                io.publish_file(str(disk / f"{i}.tmp"), str(disk / f"{i}.kvf"),
                                [payload[:100], payload[100:]], 0)
            except OSError as exc:
                errors.append(exc)
        assert errors, "the 256 KiB filesystem never filled up"
        assert {e.errno for e in errors} == {errno.ENOSPC}
        assert all(e.filename == str(disk / f"{12 - len(errors) + k}.tmp")
                   for k, e in enumerate(errors))
        assert not [p for p in disk.iterdir() if p.suffix == ".tmp"]
        for p in disk.glob("*.kvf"):
            assert p.read_bytes() == payload  # every published object is whole


def test_the_fs_tier_reports_a_full_disk_as_no_space_left(tmp_path: Path) -> None:
    from kvstore_tiers.backends.fs import FileSystemBackend, FsConfig
    from kvstore_tiers.batching import StoreItem, store_many
    from kvstore_tiers.codecs import CodecId
    from kvstore_tiers.errors import TransientError
    from kvstore_tiers.frame import FrameCodec
    from kvstore_tiers.namespace import Namespace

    with _tmpfs(tmp_path / "small", 1 << 20) as disk:
        ns = Namespace.from_run_config({"model_name": "full-disk"})
        backend = FileSystemBackend(FsConfig(root_dir=str(disk)), ns)
        backend.open()
        codec = FrameCodec(ns.digest, CodecId.NONE, backend.tuning.header_align)
        row = memoryview(mmap.mmap(-1, 64 << 10))
        results = []
        for i in range(24):
            key = i.to_bytes(32, "big") + bytes(4)
            results += store_many(backend, [StoreItem(ns.object_name(key), key, row)], codec)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, TransientError) for r in failed)
        assert all("No space left on device" in str(r) for r in failed), failed[0]
        backend.close()


def test_a_store_sends_a_row_whose_checksum_is_known_without_asking_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row stored with its CRC-32C known (a read-through fill) is not
    checksummed again; one without is checksummed by the publish call. Both
    frames carry the row's CRC-32C."""
    crc32c = pytest.importorskip("crc32c")
    from kvstore_tiers.backends.fs import FileSystemBackend, FsConfig
    from kvstore_tiers.batching import StoreItem, store_many
    from kvstore_tiers.codecs import CodecId
    from kvstore_tiers.frame import CHECKSUM_AT, FrameCodec, parse_header
    from kvstore_tiers.namespace import Namespace

    ns = Namespace.from_run_config({"model_name": "known-crc"})
    backend = FileSystemBackend(FsConfig(root_dir=str(tmp_path)), ns)
    backend.open()
    codec = FrameCodec(ns.digest, CodecId.NONE, backend.tuning.header_align)
    real, sent = fileio.publish_files, []
    monkeypatch.setattr(fileio, "publish_files",
                        lambda items, *rest: sent.extend(it[4:] for it in items)
                        or real(items, *rest))
    rows = [memoryview(bytearray(os.urandom(8192))) for _ in range(2)]
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(2)]
    items = [StoreItem(ns.object_name(keys[0]), keys[0], rows[0]),
             StoreItem(ns.object_name(keys[1]), keys[1], rows[1], crc32c.crc32c(rows[1]))]
    assert all(isinstance(r, int) and r > 0 for r in store_many(backend, items, codec))
    assert sent == [(1, CHECKSUM_AT) if fileio.PUBLISH_CRC else (), ()]
    for item, row in zip(items, rows, strict=True):
        assert parse_header(Path(backend.path(item.name)).read_bytes()).checksum == \
            crc32c.crc32c(row)
    backend.close()


_RACE_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

/* rename() as a shared filesystem answers a writer that lost a publish race:
 * another writer's copy of the same object lands first, then EEXIST. */
int rename(const char *old, const char *new) {
    static int (*real)(const char *, const char *);
    size_t n = strlen(new);
    if (n > 9 && strcmp(new + n - 9, ".race.kvf") == 0) {
        if (link(old, new) != 0)
            return -1;
        errno = EEXIST;
        return -1;
    }
    if (!real)
        real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    return real(old, new);
}
"""

_RACE_CHILD = r"""
import json, os, sys
from kvstore_tiers.backends.fs import fileio, _fsio
d = sys.argv[1]
out = {}
for label, publish in (("native", _fsio.publish_file), ("python", fileio.publish_file_py)):
    tmp, path = f"{d}/{label}.tmp", f"{d}/{label}.race.kvf"
    try:
        out[label] = publish(tmp, path, [b"frame-", b"bytes"], 0)
    except OSError as exc:
        out[label] = f"{type(exc).__name__}: {exc}"
    out[label + "_object"] = open(path, "rb").read().decode() if os.path.exists(path) else None
    out[label + "_tmp_left"] = os.path.exists(tmp)
print(json.dumps(out))
"""


def test_a_lost_publish_race_is_a_success(tmp_path: Path) -> None:
    """A rename that reports EEXIST (another writer published the block first,
    as NFS and some FUSE filesystems answer) is the object existing: 0, the
    temp file gone, the other copy in place -- not a failed store."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the rename shim")
    (tmp_path / "shim.c").write_text(_RACE_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                   check=True, capture_output=True)
    work = tmp_path / "objects"
    work.mkdir()
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    r = subprocess.run([sys.executable, "-c", _RACE_CHILD, str(work)], env=env,
                       capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for label in ("native", "python"):
        assert out[label] == 0, out
        assert out[label + "_object"] == "frame-bytes" and not out[label + "_tmp_left"]
