"""A chain of tiers in real engines: our fs tier first, a remote (redis, s3) after it.

vLLM cascades every stored block to every secondary tier and, on lookup, asks
the tiers in list order, stopping at the first HIT. One engine with the
README's three tiers (``[fs, redis, s3]``, each empty, the fs tier with
``read_through``) computes and stores the prompts; then fresh engines, each a
new process:

* ``[fs, remote]``, an empty fs root with ``read_through``: served from the
  remote; it ends with those blocks in its fs root, which alone serves a
  further engine once the remote is emptied;
* ``[fs, redis, s3]``, the cold engine's fs root, both remotes emptied: served from fs;
* ``[fs, remote]``, every fs object corrupt and, in the remote, each later
  prompt's own chunk: each corrupt object read is a miss, counted and removed,
  the first prompt is served from the remote, and a chunk corrupt in both is
  tried in both, recomputed and stored again.

Each tier's own counters and vLLM's per-tier counters say which tier served
what; every output equals the no-connector baseline's. The engine runs are
shared by the tests (one module-scoped :class:`Chain`), each made once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import (
    BLOCK,
    DISTINCT_CHUNKS,
    FULL_CHUNKS,
    assert_prompt_hits,
    outputs,
    run,
    tier_counters,
    vllm_per_tier,
)
from stored_objects import FsObjects, RedisObjects, S3Objects, StoredObjects

from tests.servers import RedisServer, s3_client

REMOTES = ("redis", "s3")
STORED = "chain"  # where the cold engine stores in each remote
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"

pytestmark = [pytest.mark.engine, pytest.mark.parametrize("remote", REMOTES)]

#: A tier of a run: its store and the location in it.
Placement = tuple[StoredObjects, str]


class ReadThroughFs(FsObjects):
    """The same directories, as fs tiers that cache the tiers after them."""

    def tier(self, where: str) -> dict[str, Any]:
        return {**super().tier(where), "read_through": True}


class Chain:
    """The module's engine runs, each made on first use and kept.

    A run's result also holds ``objects``: the names each of its tiers holds
    after the run, in tier order. Runs that read what the cold engine stored
    in the remotes come before the remotes are emptied, whatever order the
    tests ask for them in."""

    def __init__(self, model: Path, work: Path, fs: FsObjects,
                 remotes: dict[str, StoredObjects]) -> None:
        self.model, self.work, self.fs, self.remotes = model, work, fs, remotes
        self.read_through = ReadThroughFs(fs.base)  # the same directories
        self.flipped: dict[str, tuple[list[str], list[str]]] = {}
        self._runs: dict[str, dict[str, Any]] = {}
        self._emptied = False

    def _once(self, name: str, prepare: Callable[[], list[Placement]]) -> dict[str, Any]:
        if name not in self._runs:
            tiers = prepare()
            result = run(f"chain-{name}", self.model, [s.tier(w) for s, w in tiers], self.work)
            result["objects"] = [s.names(w) for s, w in tiers]
            self._runs[name] = result
        return self._runs[name]

    def cold(self) -> dict[str, Any]:
        """``[fs, redis, s3]``, all empty: computes and stores every block."""
        return self._once("cold", lambda: [(self.read_through, "cold"),
                                           *((self.remotes[r], STORED) for r in REMOTES)])

    def from_remote(self, remote: str) -> dict[str, Any]:
        """``[fs, remote]``: an empty fs root with read-through, the remote as the
        cold engine left it."""
        def prepare() -> list[Placement]:
            self.cold()
            return [(self.read_through, f"{remote}-b"), (self.remotes[remote], STORED)]
        return self._once(f"{remote}-from-remote", prepare)

    def corrupt(self, remote: str) -> dict[str, Any]:
        """``[fs, remote]``: copies of the cold engine's objects, every fs one
        flipped, and in the remote the last chunk of each prompt after the first
        (``flipped[remote]``: the remote's flipped names and its intact ones)."""
        def prepare() -> list[Placement]:
            self.cold()
            fs_where, store = self.fs.copy("cold", f"{remote}-corrupt"), self.remotes[remote]
            self.fs.flip(fs_where, self.fs.names(fs_where))
            store.copy(STORED, "corrupt")
            first, later = self._first_prompts_chunks()
            store.flip("corrupt", later)
            self.flipped[remote] = (later, first)
            return [(self.fs, fs_where), (store, "corrupt")]
        return self._once(f"{remote}-corrupt", prepare)

    def _first_prompts_chunks(self) -> tuple[list[str], list[str]]:
        """The cold engine's objects of the first prompt, and the rest (each later
        prompt's own last chunk). The engine stored the first prompt's chunks
        before it was sent the second prompt, so the rest are the last written."""
        names = self.fs.names("cold")
        names.sort(key=lambda name: (self.fs.base / "cold" / name).stat().st_mtime_ns)
        return sorted(names[:FULL_CHUNKS]), sorted(names[FULL_CHUNKS:])

    def empty_remotes(self) -> None:
        """FLUSHALL the redis server and delete every object of the bucket,
        after every run that reads what the cold engine stored there."""
        if self._emptied:
            return
        for remote in REMOTES:
            self.from_remote(remote)
            self.corrupt(remote)
        for store in self.remotes.values():
            store.clear()
            assert store.names(STORED, suffix="") == []
        self._emptied = True

    def from_fs(self) -> dict[str, Any]:
        """``[fs, redis, s3]``: the cold engine's fs root (a copy), both remotes emptied."""
        def prepare() -> list[Placement]:
            self.empty_remotes()
            return [(self.fs, self.fs.copy("cold", "from-fs")),
                    *((self.remotes[r], STORED) for r in REMOTES)]
        return self._once("from-fs", prepare)

    def from_read_through(self, remote: str) -> dict[str, Any]:
        """``[fs, remote]``: the fs root the remote-served engine filled, the remote emptied."""
        def prepare() -> list[Placement]:
            self.from_remote(remote)
            self.empty_remotes()
            return [(self.fs, f"{remote}-b"), (self.remotes[remote], STORED)]
        return self._once(f"{remote}-from-read-through", prepare)


@pytest.fixture(scope="module")
def chain(tiny_model: Path, e2e_dir: Path, moto_endpoint: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    server = RedisServer(tmp_path_factory.mktemp("chain-redis"),
                         ["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]).start()
    try:
        client = s3_client(moto_endpoint)
        bucket = f"kv-chain-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        remotes = {"redis": RedisObjects(server), "s3": S3Objects(moto_endpoint, bucket, client)}
        yield Chain(tiny_model, e2e_dir / "runs", FsObjects(tmp_path_factory.mktemp("chain-fs")),
                    remotes)
    finally:
        server.stop()


def _loaded(result: dict[str, Any], tier: str) -> int:
    return tier_counters(result, tier)["objects_loaded"]


def _assert_served_by(result: dict[str, Any], label: str, baseline: dict[str, Any]) -> None:
    """A fresh engine served as assert_prompt_hits says, every byte read from the tier
    vLLM labels ``label``, with the baseline's output."""
    assert_prompt_hits(result)
    assert outputs(result) == outputs(baseline)
    assert vllm_per_tier(result, READ_BYTES) == {label: result["metrics"][READ_BYTES]}
    assert vllm_per_tier(result, CHUNK_HITS) == {label: DISTINCT_CHUNKS}


def test_cold_engine_stores_in_every_tier(chain: Chain, remote: str,
                                          tiny_baseline: dict[str, Any]) -> None:
    cold = chain.cold()
    assert outputs(cold) == outputs(tiny_baseline)
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"]), "a tier was not empty"
    fs_objects, *remote_objects = cold["objects"]
    assert len(fs_objects) == len(remote_objects[REMOTES.index(remote)]) == DISTINCT_CHUNKS
    for tier in ("fs", remote):
        assert cold["tier_classes"][tier].startswith("kvstore_tiers."), cold["tier_classes"]
        assert tier_counters(cold, tier)["objects_stored"] == DISTINCT_CHUNKS, tier


def test_empty_fs_root_is_served_from_the_remote(chain: Chain, remote: str,
                                                 tiny_baseline: dict[str, Any]) -> None:
    warm = chain.from_remote(remote)
    _assert_served_by(warm, f"2:{remote}", tiny_baseline)
    assert _loaded(warm, remote) == DISTINCT_CHUNKS and _loaded(warm, "fs") == 0
    assert tier_counters(warm)["corrupt_objects"] == 0


def test_emptied_remote_leaves_fs_serving(chain: Chain, remote: str,
                                          tiny_baseline: dict[str, Any]) -> None:
    warm = chain.from_fs()
    _assert_served_by(warm, "1:fs", tiny_baseline)
    assert _loaded(warm, "fs") == DISTINCT_CHUNKS and _loaded(warm, remote) == 0
    assert tier_counters(warm)["corrupt_objects"] == 0


def test_corrupt_objects_are_misses_in_either_tier(chain: Chain, remote: str,
                                                   tiny_baseline: dict[str, Any]) -> None:
    result = chain.corrupt(remote)
    flipped, intact = chain.flipped[remote]
    assert flipped and intact
    assert outputs(result) == outputs(tiny_baseline)
    fs, far = tier_counters(result, "fs"), tier_counters(result, remote)
    # The remote served the first prompt; the fs tier, asked first, either rejected
    # its copies first or had not answered yet when the remote did (a RETRY loses
    # to a later HIT). A chunk corrupt in both tiers was read, and rejected, in both.
    served = [FULL_CHUNKS * BLOCK] + [0] * (len(result["prompts"]) - 1)
    assert [p["external_hit_tokens"] for p in result["prompts"]] == served
    assert (far["corrupt_objects"], far["objects_loaded"]) == (len(flipped), len(intact))
    assert fs["objects_loaded"] == 0 and fs["corrupt_objects"] >= len(flipped)
    assert vllm_per_tier(result, READ_BYTES) == {f"2:{remote}": result["metrics"][READ_BYTES]}
    # each corrupt object read was removed; what neither tier could serve was
    # recomputed and stored again in both
    assert fs["objects_stored"] == far["objects_stored"] == len(flipped)
    fs_objects, remote_objects = result["objects"]
    assert set(flipped) <= set(fs_objects)
    assert len(fs_objects) == DISTINCT_CHUNKS - fs["corrupt_objects"] + len(flipped)
    assert remote_objects == sorted(flipped + intact)


def test_read_through_fills_fs_from_the_remote(chain: Chain, remote: str,
                                               tiny_baseline: dict[str, Any]) -> None:
    filled = chain.from_remote(remote)
    fs_objects, remote_objects = filled["objects"]
    assert fs_objects == remote_objects and len(fs_objects) == DISTINCT_CHUNKS
    assert tier_counters(filled, "fs")["read_through_stored"] == DISTINCT_CHUNKS
    warm = chain.from_read_through(remote)
    _assert_served_by(warm, "1:fs", tiny_baseline)
    assert _loaded(warm, "fs") == DISTINCT_CHUNKS and _loaded(warm, remote) == 0
