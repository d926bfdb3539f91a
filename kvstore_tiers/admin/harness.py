"""Build vLLM's real tiering spec and manager on a CPU machine, and drive them
the way vLLM's scheduler does.

Used by the tests, the benchmark and ``kvstore-tiers check``: every path goes
through vLLM's own ``TieringOffloadingSpec`` -> ``TieringOffloadingManager``
-> ``SecondaryTierFactory``, exactly as in an engine, minus the GPU worker.
Works with vLLM 0.32 (no manager lock) and 0.33 (lock held around calls).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def make_offloading_config(
    secondary_tiers: Sequence[dict[str, Any]],
    *,
    num_chunks: int = 16,
    chunk_bytes: int = 4096,
    model: str = "org/model",
    dtype: str = "bfloat16",
    enable_events: bool = True,
    extra: dict[str, Any] | None = None,
) -> Any:
    """An OffloadingConfig for a primary of ``num_chunks`` rows of ``chunk_bytes``."""
    from vllm.v1.kv_offload import config as c

    extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * chunk_bytes,
        "tier_poll_interval_s": 0,
        "secondary_tiers": [dict(t) for t in secondary_tiers],
        **(extra or {}),
    }
    model_kwargs: dict[str, Any] = {"name": model, "dtype": dtype}
    if "max_model_len" in getattr(c.OffloadingModelConfig, "__dataclass_fields__", {}):
        model_kwargs["max_model_len"] = 4096
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",),
                                        group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=enable_events,
        extra_config=extra_config,
        engine_id=f"kvstore-{uuid.uuid4().hex[:10]}",
        model=c.OffloadingModelConfig(**model_kwargs),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def make_keys(n: int, seed: int = 0, group: int = 0) -> list[bytes]:
    """``n`` distinct OffloadKeys (32-byte hash + 4-byte group index)."""
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) + group.to_bytes(4, "big") for _ in range(n)]


def rows_for(keys: Sequence[bytes], row_bytes: int) -> np.ndarray:
    """Deterministic incompressible rows derived from the keys."""
    out = np.empty((len(keys), row_bytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(k[:8], "little")).integers(
            0, 256, row_bytes, dtype=np.uint8)
    return out


@dataclass
class Harness:
    """vLLM's TieringOffloadingManager with our tiers, driven like the scheduler."""

    spec: Any
    manager: Any
    steps: int = 0
    _req_counter: int = 0
    _reqs: dict[str, Any] = field(default_factory=dict)

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    @property
    def view(self) -> np.ndarray:
        """The primary tier's rows as a (num_chunks, row_bytes) uint8 array.

        Read through vLLM's public ``CPUPrimaryTierOffloadingManager.get_kv_memoryview``
        (0.32 and 0.33): the same view vLLM hands every secondary tier."""
        mv = self.manager.primary_tier.get_kv_memoryview()
        return np.frombuffer(mv, dtype=np.uint8).reshape(mv.shape[0], -1)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        lock = getattr(self.manager, "lock", None)
        if lock is None:
            yield
        else:
            with lock:
                yield

    def new_request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._req_counter += 1
        ctx = ReqContext(req_id=f"req-{self._req_counter}")
        with self.locked():
            self.manager.on_new_request(ctx)
        self._reqs[ctx.req_id] = ctx
        return ctx

    def finish_request(self, ctx: Any) -> None:
        with self.locked():
            self.manager.on_request_finished(ctx)
        self._reqs.pop(ctx.req_id, None)

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.locked():
            self.manager.on_schedule_end(ScheduleEndContext([], ()))
        self.steps += 1

    def store(self, keys: Sequence[bytes], rows: np.ndarray, ctx: Any | None = None) -> Any:
        """GPU->primary store of ``rows`` under ``keys``, then the cascade to the tiers."""
        ctx = ctx or self.new_request()
        with self.locked():
            out = self.manager.prepare_store(list(keys), ctx)
            assert out is not None, "primary tier refused the store"
            cids = np.asarray(out.store_spec.chunk_ids)
            stored_keys = list(out.keys_to_store) if hasattr(out, "keys_to_store") else list(keys)
            index = {k: i for i, k in enumerate(keys)}
            for cid, key in zip(cids, stored_keys, strict=True):
                self.view[int(cid)] = rows[index[key]]
            self.manager.complete_store(stored_keys, ctx)
        return ctx

    def store_all(self, keys: Sequence[bytes], rows: np.ndarray) -> None:
        """A request stores ``rows``; step until every job's result was consumed; finish it."""
        ctx = self.store(keys, rows)
        self.settle()
        self.finish_request(ctx)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Step until the manager has no pending work (jobs consumed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            with self.locked():
                pending = self.manager.has_pending_work()
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("manager still has pending work")
            time.sleep(0.001)

    def forget_primary(self) -> None:
        """Make the primary tier forget everything (as after a cache reset)."""
        with self.locked():
            self.manager.reset_cache()
            if hasattr(self.manager, "on_reset_flushed"):
                self.manager.on_reset_flushed()

    def lookup_until_resolved(self, keys: Sequence[bytes], ctx: Any, timeout_s: float = 60.0
                              ) -> tuple[list[Any], int]:
        """Look ``keys`` up each step, as the scheduler does, until none is RETRY
        or HIT_PENDING. Returns (final results, steps taken). Gives up with
        TimeoutError once ``timeout_s`` seconds have passed (as :meth:`settle`): a
        time, not a step count, since a busy machine can spend hundreds of steps'
        worth of time on one load."""
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + timeout_s
        n = 0
        while True:
            n += 1
            with self.locked():
                results = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return results, n
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"lookups unresolved after {timeout_s:g} s ({n} steps): {results}")
            self.step()
            time.sleep(0.002)

    def load(self, keys: Sequence[bytes], ctx: Any) -> np.ndarray:
        """Rows of ``keys`` as loaded into the primary (prepare_load/complete_load)."""
        with self.locked():
            spec = self.manager.prepare_load(list(keys), ctx)
            rows = self.view[np.asarray(spec.chunk_ids)].copy()
            self.manager.complete_load(list(keys), ctx)
        return rows

    def shutdown(self) -> None:
        self.manager.shutdown()


def build_harness(secondary_tiers: Sequence[dict[str, Any]], **kwargs: Any) -> Harness:
    """Spec + manager through vLLM's factories; tiers resolved by SecondaryTierFactory."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvstore_tiers.plugin import register

    register()
    spec = OffloadingSpecFactory.create_spec(make_offloading_config(secondary_tiers, **kwargs))
    return Harness(spec=spec, manager=spec.get_manager())
