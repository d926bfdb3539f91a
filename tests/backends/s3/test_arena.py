"""The arena GET bodies land in: buffers of the size asked, apart from each other, in
mappings that come back for reuse (up to a bound, else are unmapped) when their last body
goes, and not before; used only where the kernel gives huge pages; and a body read into
it: whole, short (for the caller's check) or refused when longer than announced."""

from __future__ import annotations

import asyncio
import gc
import mmap
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstore_tiers.backends.s3 import arena as arena_mod
from kvstore_tiers.backends.s3.arena import HUGE_PAGE, BodyArena, huge_pages_available
from kvstore_tiers.backends.s3.backend import S3Backend
from kvstore_tiers.errors import TransientError


def _mapping_of(view: memoryview) -> mmap.mmap:
    obj = view.obj
    if isinstance(obj, np.ndarray):  # a shared mapping's view: its own exporter
        obj = obj.base.obj
    assert isinstance(obj, mmap.mmap), obj
    return obj


def test_bodies_are_writable_exactly_sized_and_apart() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    a, b = arena.take(1000), arena.take(3000)
    assert (len(a), len(b)) == (1000, 3000) and not a.readonly
    a[:] = b"a" * 1000
    b[:] = b"b" * 3000
    assert bytes(a) == b"a" * 1000 and bytes(b) == b"b" * 3000
    assert _mapping_of(a) is _mapping_of(b)  # carved from one mapping


def test_a_used_up_mapping_is_followed_by_a_new_one() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    first = arena.take(HUGE_PAGE)
    second = arena.take(HUGE_PAGE)  # fills the first mapping exactly
    third = arena.take(HUGE_PAGE)
    assert _mapping_of(first) is _mapping_of(second)
    assert _mapping_of(third) is not _mapping_of(first)
    third[:] = b"\x01" * HUGE_PAGE  # writing one never touches another
    assert first.tobytes().count(1) == 0 and second.tobytes().count(1) == 0


def test_a_body_larger_than_half_a_mapping_gets_its_own() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    small = arena.take(100)
    big = arena.take(HUGE_PAGE + 1)
    assert len(big) == HUGE_PAGE + 1
    assert _mapping_of(big) is not _mapping_of(small)
    after = arena.take(100)  # the shared mapping goes on where it was
    assert _mapping_of(after) is _mapping_of(small)


def test_a_mapping_goes_when_its_last_body_goes_and_none_is_kept() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2, keep_bytes=0)
    body, other = arena.take(HUGE_PAGE), arena.take(HUGE_PAGE)  # the first mapping, full
    gone = weakref.ref(_mapping_of(body))
    later = arena.take(100)  # the arena moves on to a new mapping
    assert _mapping_of(later) is not gone()
    del body
    gc.collect()
    assert gone() is not None  # the other body still holds it
    del other
    gc.collect()
    assert gone() is None and arena.kept == 0


def test_an_emptied_mapping_comes_back_and_is_reused() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    bodies = [arena.take(HUGE_PAGE) for _ in range(2)]  # the first mapping, full
    first = _mapping_of(bodies[0])
    later = arena.take(100)  # the arena moves on to a second mapping
    assert _mapping_of(later) is not first and arena.kept == 0
    bodies.pop()
    assert arena.kept == 0  # one body still holds it
    bodies.pop()
    assert arena.kept == 1  # the last one gone: back at once, no collection needed
    arena.take(HUGE_PAGE)  # fills the second mapping up
    arena.take(HUGE_PAGE - 128)
    reused = arena.take(HUGE_PAGE)
    assert _mapping_of(reused) is first and arena.kept == 0
    reused[:] = b"\x02" * HUGE_PAGE  # a reused mapping is as writable as a fresh one
    assert bytes(reused[:4]) == b"\x02" * 4


def test_what_is_made_from_a_body_keeps_its_mapping_from_reuse() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    body, other = arena.take(HUGE_PAGE), arena.take(HUGE_PAGE)  # the first mapping, full
    arena.take(100)  # the arena moves on
    del other
    row = np.frombuffer(body, dtype=np.uint16)  # as the core decodes a frame's payload
    derived = memoryview(body)[10:20]
    del body
    gc.collect()
    assert arena.kept == 0  # the row and the slice still read it: not handed out again
    del row
    gc.collect()
    assert arena.kept == 0
    del derived
    assert arena.kept == 1


def test_a_body_in_a_reference_cycle_comes_back_with_the_collector() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    cycle: dict[str, Any] = {"bodies": [arena.take(HUGE_PAGE), arena.take(HUGE_PAGE)]}
    cycle["self"] = cycle  # as a traceback holding a body would
    arena.take(100)
    del cycle
    assert arena.kept == 0
    gc.collect()  # the collector frees it, on whatever thread: no lock taken there
    assert arena.kept == 1


def test_the_arena_keeps_no_more_than_its_bound() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2, keep_bytes=HUGE_PAGE * 4)  # two mappings
    bodies = [arena.take(HUGE_PAGE) for _ in range(8)]  # four mappings, two bodies each
    maps = [weakref.ref(_mapping_of(b)) for b in bodies[::2]]
    arena.take(100)  # the arena moves on from the fourth
    del bodies
    gc.collect()
    assert arena.kept == 2
    assert sum(m() is not None for m in maps) == 2  # the other two were unmapped


def test_a_body_larger_than_half_a_mapping_is_never_kept() -> None:
    arena = BodyArena(chunk_bytes=HUGE_PAGE * 2)
    big = arena.take(HUGE_PAGE * 3)
    gone = weakref.ref(_mapping_of(big))
    del big
    gc.collect()
    assert gone() is None and arena.kept == 0


def test_a_chunk_size_that_is_not_whole_huge_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple"):
        BodyArena(chunk_bytes=HUGE_PAGE + 4096)
    with pytest.raises(ValueError, match="keep_bytes"):
        BodyArena(keep_bytes=-1)


@pytest.mark.parametrize(("setting", "available"), [
    ("always [madvise] never\n", True),
    ("[always] madvise never\n", True),
    ("always madvise [never]\n", False),
])
def test_huge_pages_are_used_only_where_the_kernel_gives_them(
        tmp_path: Path, setting: str, available: bool) -> None:
    path = tmp_path / "enabled"
    path.write_text(setting)
    assert huge_pages_available(path) is available
    assert huge_pages_available(tmp_path / "absent") is False


def test_without_madvise_support_there_are_no_huge_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "enabled"
    path.write_text("[always] madvise never\n")
    monkeypatch.delattr(arena_mod.mmap, "MADV_HUGEPAGE")
    assert huge_pages_available(path) is False


class _Stream:
    """A response body that hands over ``data`` ``step`` bytes per read."""

    def __init__(self, data: bytes, step: int = 3) -> None:
        self.data, self.step, self.pos = data, step, 0

    async def readinto(self, b: Any) -> int:
        n = min(len(b), self.step, len(self.data) - self.pos)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    async def read(self) -> bytes:
        rest, self.pos = self.data[self.pos:], len(self.data)
        return rest


def _read(data: bytes, size: int | None, arena: BodyArena | None = None) -> Any:
    owner = SimpleNamespace(_arena=BodyArena() if arena is None else arena)
    return asyncio.run(S3Backend._read_body(owner, _Stream(data), size))  # type: ignore[arg-type]


def test_a_body_lands_in_the_arena_whole() -> None:
    body = _read(b"0123456789", 10)
    assert isinstance(body, memoryview) and bytes(body) == b"0123456789"


def test_a_body_that_ends_early_comes_back_short() -> None:
    body = _read(b"01234", 10)  # the caller's short-read check sees 5 of 10
    assert bytes(body) == b"01234"


def test_a_body_longer_than_announced_is_refused() -> None:
    with pytest.raises(TransientError, match="longer than its Content-Length"):
        _read(b"0123456789AB", 10)


def test_without_a_size_the_client_s_bytes_come_back() -> None:
    assert _read(b"0123456789", None) == b"0123456789"
