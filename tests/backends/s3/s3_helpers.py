"""Shared helpers of the s3 tests: drive vLLM's real manager through the harness."""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import Harness, build_harness, make_keys
from kvstore_tiers.tools import samples
from tests.conftest import KV_SAMPLES_DIR

from ...conftest import rows_like as random_rows

SAMPLES = KV_SAMPLES_DIR
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def harness(cfg: dict[str, Any], *, num_chunks: int = 32, chunk_bytes: int = 16384,
            **kw: Any) -> Harness:
    return build_harness([cfg], num_chunks=num_chunks, chunk_bytes=chunk_bytes, **kw)






def fetch(h: Harness, keys: list[bytes]) -> tuple[list[Any], np.ndarray | None, Any]:
    """A new request looks ``keys`` up (promotions run) and loads the HITs.

    Returns (lookup results, rows of the HIT keys in order, request context).
    """
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
    rows = h.load(hits, ctx) if hits else None
    h.settle()
    return results, rows, ctx


def round_trips(cfg: dict[str, Any], n: int, seed: int) -> None:
    """An engine on ``cfg`` stores ``n`` random blocks; once out of its primary
    tier they all load back from s3 byte-exact."""
    h = harness(cfg)
    try:
        keys, rows = make_keys(n, seed=seed), random_rows(n, 16384, seed=seed)
        h.store_all(keys, rows)
        h.forget_primary()
        results, got, _ = fetch(h, keys)
        assert results == [HIT] * n and np.array_equal(got, rows)
    finally:
        h.shutdown()


def sample_blocks(file: str = "smollm2-135m_bf16_n16.bin") -> np.ndarray:
    """The real bf16 KV blocks of kv-samples as (num_blocks, block_bytes) uint8."""
    return next(blocks for entry, blocks in samples.load(SAMPLES) if entry["file"] == file)


__all__ = ["HIT", "MISS", "fetch", "harness", "make_keys", "random_rows", "round_trips",
           "sample_blocks"]
