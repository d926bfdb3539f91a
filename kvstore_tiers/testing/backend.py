"""The backend conformance suite: what every :class:`Backend` must do.

Subclass :class:`BackendTests` in a ``Test*`` class and say how to build your
backend; pytest then runs every test below against it::

    from kvstore_tiers.testing.backend import BackendTests

    class TestMyBackend(BackendTests):
        def make_backend(self, namespace, tmp_path):
            return MyBackend(MyConfig(url=...), namespace)  # not opened yet

The suite opens the backend, runs one test, then closes it. Each test needs
an empty store (its own ``tmp_path``, key prefix, bucket or server). A
backend whose objects cannot be damaged through ``put`` (a store that
checks what it is given) overrides :meth:`BackendTests.damage`; one that
cannot hold two namespaces side by side overrides nothing: the suite only
puts objects under the names a namespace makes.

What is checked: the byte contract (``put`` of several parts round-trips;
``put`` of an existing object returns False and leaves it alone; a
half-written object is never visible; ``exists_many`` answers in order;
``delete`` of a missing object is fine; ``iter_objects`` lists names, sizes
and honours a prefix), the batch calls ``write_many`` (per
write the bytes written, 0 for an existing object, the error) and
``read_many`` (each object's bytes into the caller's buffers, one result per
read, an object longer than its buffers placing what fits and saying its
size), the CRC-32C of ``supports_crc32c``, the optional methods per their
``supports_*`` flags, the tuning value, the core's
:func:`~kvstore_tiers.batching.store_many`/:func:`~kvstore_tiers.batching.load_many`
over the backend through a real :class:`~kvstore_tiers.frame.FrameCodec`
with per-item results (a missing object is ObjectMissing, a damaged,
truncated or foreign one ObjectCorrupt, never wrong bytes), and concurrent
use from threads.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvstore_tiers.backends.base import LISTING_HEAD, Backend, IOTuning, Read, Write
from kvstore_tiers.batching import LoadItem, StoreItem, load_many, store_many
from kvstore_tiers.codecs import CodecId
from kvstore_tiers.errors import ObjectCorrupt, ObjectMissing
from kvstore_tiers.frame import FrameCodec, checksum
from kvstore_tiers.namespace import Namespace

__all__ = ["BackendTests"]


def _namespace(model: str) -> Namespace:
    return Namespace.from_run_config({"model_name": model, "dtype": "bfloat16",
                                      "tokens_per_hash": 16, "layout": "conformance"})


def _key(i: int, group: int = 0) -> bytes:
    """A block key (32-byte hash + 4-byte group), distinct per ``i``."""
    return np.random.default_rng(i).bytes(32) + group.to_bytes(4, "big")


class BackendTests:
    """Conformance tests; subclass and implement :meth:`make_backend`."""

    #: Bytes of one row in the frame tests (a multiple of the page size, as
    #: vLLM's rows are, so O_DIRECT paths run).
    row_bytes: int = 4 * mmap.PAGESIZE
    # -- what a subclass provides ------------------------------------------------------
    def make_backend(self, namespace: Namespace, tmp_path: Path) -> Backend:
        """A new, unopened backend over an empty store for ``namespace``."""
        raise NotImplementedError("subclass BackendTests and implement make_backend")

    def damage(self, backend: Backend, name: str, data: bytes) -> None:
        """Replace object ``name`` with ``data`` (to plant a corrupt object)."""
        backend.delete(name)
        assert backend.put(name, [data]) is True

    # -- fixtures ------------------------------------------------------------------------
    @pytest.fixture
    def namespace(self) -> Namespace:
        return _namespace("conformance/model")

    @pytest.fixture
    def backend(self, namespace: Namespace, tmp_path: Path) -> Iterator[Backend]:
        b = self.make_backend(namespace, tmp_path)
        b.open()
        try:
            yield b
        finally:
            b.close()

    @pytest.fixture(params=[CodecId.NONE, CodecId.ZSTD], ids=["none", "zstd"])
    def codec(self, request: pytest.FixtureRequest, backend: Backend,
              namespace: Namespace) -> FrameCodec:
        return FrameCodec(namespace.digest, request.param, backend.tuning.header_align)

    # -- helpers -------------------------------------------------------------------------
    def rows(self, n: int, seed: int = 0) -> list[memoryview]:
        """``n`` page-aligned rows (as the core's are) of compressible random bytes."""
        view = memoryview(mmap.mmap(-1, max(1, n * self.row_bytes)))
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            row = view[i * self.row_bytes:(i + 1) * self.row_bytes]
            row[:] = rng.integers(0, 8, self.row_bytes, dtype=np.uint8).tobytes()
            out.append(row)
        return out

    def empty_rows(self, n: int) -> list[memoryview]:
        view = memoryview(mmap.mmap(-1, max(1, n * self.row_bytes)))
        return [view[i * self.row_bytes:(i + 1) * self.row_bytes] for i in range(n)]

    @staticmethod
    def name(namespace: Namespace, i: int) -> str:
        return namespace.object_name(_key(i))

    def store(self, backend: Backend, codec: FrameCodec, namespace: Namespace,
              ids: list[int], rows: list[memoryview]) -> list[int | BaseException]:
        items = [StoreItem(self.name(namespace, i), _key(i), r)
                 for i, r in zip(ids, rows, strict=True)]
        return store_many(backend, items, codec)

    def load(self, backend: Backend, codec: FrameCodec, namespace: Namespace,
             ids: list[int], dests: list[memoryview]) -> list[int | BaseException]:
        items = [LoadItem(self.name(namespace, i), _key(i), d)
                 for i, d in zip(ids, dests, strict=True)]
        return load_many(backend, items, codec)

    # -- the byte contract ---------------------------------------------------------------
    def test_put_get_round_trip_of_parts(self, backend: Backend, namespace: Namespace) -> None:
        name = self.name(namespace, 1)
        tail = bytearray(b"world" * 1000)
        assert backend.put(name, [b"hello ", memoryview(tail), b""]) is True
        tail[:5] = b"XXXXX"  # the caller reuses its buffer: the stored object must not change
        assert bytes(backend.get(name)) == b"hello " + b"world" * 1000

    def test_put_of_an_existing_object_returns_false_and_leaves_it(
            self, backend: Backend, namespace: Namespace) -> None:
        name = self.name(namespace, 2)
        assert backend.put(name, [b"first"]) is True
        assert backend.put(name, [b"second", b"!"]) is False
        assert bytes(backend.get(name)) == b"first"

    def test_get_of_a_missing_object_is_object_missing(
            self, backend: Backend, namespace: Namespace) -> None:
        with pytest.raises(ObjectMissing):
            backend.get(self.name(namespace, 3))

    def test_exists_many_answers_in_order(self, backend: Backend, namespace: Namespace) -> None:
        a, b, missing = (self.name(namespace, i) for i in (4, 5, 6))
        backend.put(a, [b"a"])
        backend.put(b, [b"b"])
        assert backend.exists_many([a, missing, b, a]) == [True, False, True, True]
        assert backend.exists_many([]) == []

    def test_delete_removes_and_a_missing_object_is_not_an_error(
            self, backend: Backend, namespace: Namespace) -> None:
        name = self.name(namespace, 7)
        backend.put(name, [b"x"])
        backend.delete(name)
        backend.delete(name)
        backend.delete(self.name(namespace, 8))
        assert backend.exists_many([name]) == [False]
        with pytest.raises(ObjectMissing):
            backend.get(name)
        assert backend.put(name, [b"again"]) is True  # a deleted name can be stored anew

    def test_iter_objects_lists_names_and_sizes_under_a_prefix(
            self, backend: Backend, namespace: Namespace) -> None:
        other = _namespace("conformance/other-model")
        mine = {self.name(namespace, i): 100 + i for i in range(10, 15)}
        theirs = {self.name(other, i): 50 for i in range(10, 12)}
        for name, size in {**mine, **theirs}.items():
            backend.put(name, [bytes(size)])
        listed = {o.name: o for o in backend.iter_objects(namespace.name)}
        assert {n: o.size for n, o in listed.items()} == mine
        for name, o in listed.items():  # a time, or the object's first bytes to read one from
            if o.mtime is None:
                assert o.head == bytes(min(mine[name], LISTING_HEAD))
            else:
                assert isinstance(o.mtime, float) and o.head is None
        assert {o.name for o in backend.iter_objects()} >= set(mine) | set(theirs)
        one = next(iter(mine))
        shard = one.rsplit("/", 1)[0] + "/"
        assert {o.name for o in backend.iter_objects(shard)} == {n for n in mine
                                                                 if n.startswith(shard)}
        assert list(backend.iter_objects(namespace.name + "/fff/none")) == []

    def test_a_half_written_object_is_never_visible(
            self, backend: Backend, namespace: Namespace) -> None:
        """Readers racing a writer see nothing or the whole object, never a part."""
        size, names = 1 << 20, [self.name(namespace, 100 + i) for i in range(12)]
        stop, seen, bad = threading.Event(), [0], []

        def reader() -> None:
            while not stop.is_set():
                for n in names:
                    try:
                        data = bytes(backend.get(n))
                    except ObjectMissing:
                        continue
                    seen[0] += 1
                    if len(data) != size or data != data[:1] * size:
                        bad.append((n, len(data)))

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i, n in enumerate(names):
                half = bytes([i + 1]) * (size // 2)
                assert backend.put(n, [half, half]) is True
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not bad, f"torn objects seen: {bad[:3]}"
        assert all(bytes(backend.get(n))[:1] == bytes([i + 1]) for i, n in enumerate(names))

    # -- optional methods, per their flags -------------------------------------------------
    def test_supports_flags_match_the_methods(self, backend: Backend) -> None:
        cls = type(backend)
        assert cls.supports_delete_many == (cls.delete_many is not Backend.delete_many)
        assert cls.supports_touch == (cls.touch_many is not Backend.touch_many)
        if cls.supports_crc32c:  # a checksum is only computed where the bytes move natively
            assert cls.read_many is not Backend.read_many
            assert cls.write_many is not Backend.write_many

    def test_delete_many_removes_every_name(self, backend: Backend, namespace: Namespace) -> None:
        names = [self.name(namespace, 200 + i) for i in range(6)]
        for n in names:
            backend.put(n, [b"x" * 10])
        backend.delete_many([names[0], names[2], self.name(namespace, 299), names[4]])
        assert backend.exists_many(names) == [False, True, False, True, False, True]
        backend.delete_many([])

    def test_touch_many_keeps_objects_and_ignores_missing(
            self, backend: Backend, namespace: Namespace) -> None:
        names = [self.name(namespace, 300 + i) for i in range(3)]
        for n in names:
            backend.put(n, [b"t" * 10])
        backend.touch_many([*names, self.name(namespace, 399)])
        backend.touch_many([])
        assert backend.exists_many(names) == [True] * 3
        assert all(bytes(backend.get(n)) == b"t" * 10 for n in names)

    # -- the batch calls: bytes only -----------------------------------------------------
    def test_write_many_writes_every_object_and_leaves_an_existing_one(
            self, backend: Backend, namespace: Namespace) -> None:
        names = [self.name(namespace, 400 + i) for i in range(3)]
        assert backend.put(names[1], [b"old"]) is True
        parts = [(b"head", memoryview(bytes([i]) * 5000)) for i in range(3)]
        out = backend.write_many([Write(n, p) for n, p in zip(names, parts, strict=True)])
        assert out == [5004, 0, 5004]
        assert bytes(backend.get(names[0])) == b"head" + b"\x00" * 5000
        assert bytes(backend.get(names[1])) == b"old", "an existing object is left alone"
        assert backend.write_many([]) == []

    def test_read_many_scatters_each_object_into_its_buffers(
            self, backend: Backend, namespace: Namespace) -> None:
        data = [bytes(np.random.default_rng(i).integers(0, 256, 3000 + 500 * i,
                                                        dtype=np.uint8)) for i in range(3)]
        names = [self.name(namespace, 410 + i) for i in range(4)]
        for n, d in zip(names, data, strict=False):
            assert backend.put(n, [d])

        def buffers(*sizes: int) -> list[memoryview]:
            return [memoryview(bytearray(n)) for n in sizes]

        reads = [Read(names[0], buffers(100, 2900)),  # exactly the object
                 Read(names[1], buffers(64, 5000, 64)),  # more room than the object
                 Read(names[2], buffers(10, 990)),  # less: what fits, and its size
                 Read(names[3], buffers(64))]  # no object
        got = dict(backend.read_many(reads))
        assert sorted(got) == [0, 1, 2, 3], "one result per read"
        for i, want in enumerate(data):
            done, read = got[i], reads[i]
            if not isinstance(done, tuple):  # handed over whole, not copied into the parts
                assert bytes(done) == want
                continue
            placed, size, _crc = done
            room = sum(len(p) for p in read.parts)
            assert (placed, size) == (min(len(want), room), len(want))
            assert b"".join(bytes(p) for p in read.parts)[:placed] == want[:placed]
        assert isinstance(got[3], ObjectMissing)
        assert list(backend.read_many([])) == []

    def test_crc32c_where_supported(self, backend: Backend, namespace: Namespace) -> None:
        """A write asked for a crc puts the CRC-32C of its part in the object; a read
        asked for one gives that part's CRC-32C (or None: not computed)."""
        if not type(backend).supports_crc32c:
            return
        name = self.name(namespace, 420)
        (row,) = self.rows(1, seed=6)
        assert backend.write_many([Write(name, (bytearray(64), row), (1, 16))]) == \
            [64 + len(row)]
        stored = bytes(backend.get(name))
        assert int.from_bytes(stored[16:20], "little") == checksum(row)
        assert stored[20:24] == bytes(4), "only the 4 bytes of the checksum are written"
        assert stored[64:] == bytes(row)
        head, (dest,) = memoryview(bytearray(64)), self.empty_rows(1)
        ((i, (placed, size, crc)),) = list(backend.read_many([Read(name, (head, dest), 1)]))
        assert (i, placed, size) == (0, 64 + len(row), 64 + len(row))
        assert crc is None or crc == checksum(row)

    def test_tuning_is_one_sane_value(self, backend: Backend) -> None:
        t = backend.tuning
        assert isinstance(t, IOTuning)
        assert t.load_batch >= 1 and t.store_batch >= 1
        assert t.header_align >= 8 and t.header_align & (t.header_align - 1) == 0
        assert t.max_load_batch_bytes is None or t.max_load_batch_bytes > 0

    # -- frames: what the core calls ---------------------------------------------------------
    def test_store_many_and_load_many_return_per_item_results(
            self, backend: Backend, codec: FrameCodec, namespace: Namespace) -> None:
        rows = self.rows(3, seed=1)
        stored = self.store(backend, codec, namespace, [500, 501, 502], rows)
        assert all(type(n) is int and n > 0 for n in stored), stored
        again = self.store(backend, codec, namespace, [500, 501, 502], self.rows(3, seed=2))
        assert again == [0, 0, 0], "an existing object is left alone and reported as 0"
        dests = self.empty_rows(4)
        loaded = self.load(backend, codec, namespace, [500, 599, 501, 502], dests)
        assert isinstance(loaded[1], ObjectMissing)
        assert [loaded[0], loaded[2], loaded[3]] == stored
        assert [dests[0], dests[2], dests[3]] == rows, "the first store's bytes, verified"
        assert self.store(backend, codec, namespace, [], []) == []
        assert self.load(backend, codec, namespace, [], []) == []

    def test_a_load_says_the_crc_of_each_row_it_verified(
            self, backend: Backend, codec: FrameCodec, namespace: Namespace) -> None:
        """``LoadItem.crc``: what the frame checks returned, never a wrong value
        (read-through compares a primary row with it before caching the block)."""
        self.store(backend, codec, namespace, [700, 701], self.rows(2, seed=4))
        items = [LoadItem(self.name(namespace, i), _key(i), d)
                 for i, d in zip([700, 701], self.empty_rows(2), strict=True)]
        assert all(type(n) is int for n in load_many(backend, items, codec))
        for item in items:
            assert item.crc == checksum(item.dest)

    @pytest.mark.parametrize("how", ["bitflip", "truncated", "foreign", "garbage"])
    def test_a_damaged_object_is_corrupt_and_its_batch_neighbours_load(
            self, backend: Backend, codec: FrameCodec, namespace: Namespace, how: str) -> None:
        rows = self.rows(3, seed=3)
        self.store(backend, codec, namespace, [600, 601, 602], rows)
        victim = self.name(namespace, 601)
        frame = bytes(backend.get(victim))
        if how == "bitflip":
            data = frame[:-1] + bytes([frame[-1] ^ 0x01])
        elif how == "truncated":
            data = frame[:-1]
        elif how == "foreign":  # another key's frame under this name
            data = bytes(backend.get(self.name(namespace, 600)))
        else:
            data = b"\x00" * len(frame)
        self.damage(backend, victim, data)
        dests = self.empty_rows(3)
        loaded = self.load(backend, codec, namespace, [600, 601, 602], dests)
        assert isinstance(loaded[1], ObjectCorrupt), loaded[1]
        assert isinstance(loaded[0], int) and isinstance(loaded[2], int)
        assert dests[0] == rows[0] and dests[2] == rows[2]

    def test_a_frame_of_another_namespace_is_corrupt(
            self, backend: Backend, codec: FrameCodec, namespace: Namespace) -> None:
        other = FrameCodec(_namespace("conformance/elsewhere").digest, codec.codec,
                           codec.header_align)
        (row,) = self.rows(1, seed=4)
        self.store(backend, other, namespace, [700], [row])
        (loaded,) = self.load(backend, codec, namespace, [700], self.empty_rows(1))
        assert isinstance(loaded, ObjectCorrupt)

    def test_concurrent_use_from_threads(self, backend: Backend, namespace: Namespace) -> None:
        """Eight threads store, load, check and delete overlapping keys: every
        result is per item, and a load yields the right bytes or a miss."""
        ids = list(range(800, 816))
        rows = dict(zip(ids, self.rows(len(ids), seed=6), strict=True))
        align = backend.tuning.header_align

        def work(t: int) -> int:
            codec = FrameCodec(namespace.digest, CodecId.ZSTD if t % 2 else CodecId.NONE, align)
            mine = ids[t % 4::2]
            ok = 0
            for round_ in range(6):
                for res in self.store(backend, codec, namespace, mine, [rows[i] for i in mine]):
                    assert isinstance(res, int), res
                dests = self.empty_rows(len(mine))
                for i, d, res in zip(mine, dests,
                                     self.load(backend, codec, namespace, mine, dests),
                                     strict=True):
                    if isinstance(res, ObjectMissing):
                        continue  # deleted by another thread in between
                    assert isinstance(res, int), res
                    assert d == rows[i], "wrong bytes loaded"
                    ok += 1
                backend.exists_many([self.name(namespace, i) for i in mine])
                if round_ % 3 == t % 3:
                    backend.delete(self.name(namespace, mine[0]))
            return ok

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(work, range(8))) > 0
