"""One node of the fleet replay (:mod:`.fleet`): a process with its own vLLM manager.

:func:`serve` runs in a process the coordinator spawns. It answers the
coordinator's messages on its end of a pipe, one at a time, each with
``("ok", value)`` or ``("error", traceback)``:

* ``("calibrate", spec)``: the fs tier's bytes on disk (fixed, per object) for
  chunks of ``spec["chunk_bytes"]`` (:func:`.trace.fs_object_bytes`, in
  ``spec["root_dir"]``, removed afterwards);
* ``("start", spec)``: build vLLM's real ``TieringOffloadingManager`` with
  the tiers ``spec["tiers"]`` (the node's fs tier, then the shared remote),
  a primary of ``spec["primary_blocks"]`` rows of ``spec["chunk_bytes"]``;
* ``("request", (timestamp_ms, input_length, output_length, hash_ids))``:
  replay one request (:class:`FleetReplayer`), then wait for its cascades,
  so that the next request of the trace, on any node, finds them stored;
* ``("finish", None)``: the node's counts (:meth:`FleetReplayer.result`);
  the manager is shut down;
* ``("stop", None)``: the process ends (no answer).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.bench.trace import Replayer, block_key, fs_object_bytes, payload_rows
from kvstore_tiers.tools.bench.trace_file import TraceRequest

#: Where a node's leading hits came from: vLLM's primary, then each tier by index.
SOURCES = ("primary", "fs", "remote")


class FleetReplayer(Replayer):
    """A :class:`~.trace.Replayer` over a chain of tiers that also counts

    * each leading hit by where it came from: vLLM's ``get_load_source``
      tells the primary (``HOST``) from a secondary tier (``DISK``, the same
      for every tier of ours), and the tier is the one vLLM handed the
      block's promotion to (``submit_load`` of the tier at that index);
    * the blocks each tier reported stored (written, or found there already)
      in its kv events: for the remote tier, the blocks this node sent it;
    * the remote loads of a block this node loaded from the remote before
      (``remote_repeats``): with read-through off, the most it could save.
    """

    def __init__(self, harness: Any, rows: Any) -> None:
        super().__init__(harness, rows)
        tiers = harness.tiers
        self.by_source = [0] * (1 + len(tiers))
        self.remote_offered = 0  # keys in the remote tier's stored events (repeats counted)
        self.remote_blocks: set[int] = set()
        self.remote_repeats = 0
        self._remote_loaded: set[bytes] = set()
        self._loaded_from: dict[bytes, int] = {}
        self._ids: dict[bytes, int] = {}
        for i, tier in enumerate(tiers):
            self._watch_loads(i, tier)

    def _watch_loads(self, index: int, tier: Any) -> None:
        """Note the tier index of every key vLLM asks ``tier`` to promote."""
        submit = tier.submit_load
        loaded_from = self._loaded_from

        def submit_load(job: Any) -> None:
            loaded_from.update(dict.fromkeys(job.keys, index))
            submit(job)

        tier.submit_load = submit_load

    def request(self, req: TraceRequest, timeout_s: float = 120.0) -> None:
        """Replay ``req`` (:meth:`.Replayer.request`), then wait for its cascades."""
        self._loaded_from.clear()
        self._ids.update((block_key(b), b) for b in req.hash_ids)
        super().request(req, timeout_s)
        self.settle(timeout_s)
        self.take_events()

    def settle(self, timeout_s: float) -> None:
        """Step until the manager's jobs and the fs tier's read-through fills are done
        and applied."""
        self.h.settle(timeout_s)  # fills included: the fs tier has pending work till written
        self.h.step()  # the fills' completions reach the fs tier's index and counters

    def _hit_sources(self, keys: list[bytes], sources: list[Any]) -> None:
        disk, remote = self.tier.cache_hit_source, len(self.h.tiers) - 1
        for k, s in zip(keys, sources, strict=True):
            source = self._loaded_from[k] if s == disk else -1
            self.by_source[1 + source] += 1
            if source == remote:
                self.remote_repeats += k in self._remote_loaded
                self._remote_loaded.add(k)

    def take_events(self) -> None:
        """Drain the kv events; keep the blocks the remote tier (the last) stored."""
        h = self.h
        with h.locked():
            list(h.manager.primary_tier.take_events())
            for tier in h.tiers[:-1]:
                list(tier.take_events())
            remote = list(h.tiers[-1].take_events())
        for ev in remote:
            if not ev.removed:
                self.remote_offered += len(ev.keys)
                self.remote_blocks.update(self._ids[k] for k in ev.keys)

    def result(self) -> dict[str, Any]:
        """The node's counts, once every cascade finished."""
        tiers = {}
        for name, tier in zip(SOURCES[1:], self.h.tiers, strict=True):
            counters = dataclasses.asdict(tier.counters)
            evictions = tier.backend.evictions
            counters["evicted_objects"] = evictions.objects if evictions is not None else 0
            tiers[name] = counters
        requests = getattr(self.h.tiers[-1].backend, "requests", None)
        return {"replay": dataclasses.asdict(self.stats),
                "hits": dict(zip(SOURCES, self.by_source, strict=True)),
                **tiers, "remote_offered": self.remote_offered,
                "remote_repeats": self.remote_repeats,
                "remote_blocks": sorted(self.remote_blocks),
                "requests_by_kind": dict(requests) if requests is not None else None}


class _Node:
    """The node's manager between ``start`` and ``finish``."""

    def __init__(self) -> None:
        self.harness: Any = None
        self.replayer: FleetReplayer | None = None
        self.t0 = 0.0

    def start(self, spec: dict[str, Any]) -> None:
        from kvstore_tiers.admin.harness import build_harness

        samples = spec.get("samples_dir")
        rows = payload_rows(spec["chunk_bytes"], Path(samples) if samples else None)
        # The remote tier's stored events name the blocks this node sent it.
        tiers = [*spec["tiers"][:-1], {**spec["tiers"][-1], "enable_kv_events": True}]
        self.harness = build_harness(tiers, num_chunks=spec["primary_blocks"],
                                     chunk_bytes=spec["chunk_bytes"], enable_events=True)
        self.replayer = FleetReplayer(self.harness, rows)
        self.t0 = time.perf_counter()

    @staticmethod
    def calibrate(spec: dict[str, Any]) -> tuple[int, int]:
        """:func:`.trace.fs_object_bytes` with this node's payload."""
        chunk, samples = spec["chunk_bytes"], spec.get("samples_dir")
        rows = payload_rows(chunk, Path(samples) if samples else None)
        return fs_object_bytes(Path(spec["root_dir"]), chunk, rows)

    def request(self, fields: tuple[Any, ...]) -> None:
        assert self.replayer is not None, "request before start"
        ts, n_in, n_out, ids = fields
        self.replayer.request(TraceRequest(ts, n_in, n_out, tuple(ids)))

    def finish(self) -> dict[str, Any]:
        assert self.replayer is not None, "finish before start"
        try:
            self.replayer.settle(timeout_s=600)
            self.replayer.take_events()
            self.replayer.stats.seconds = time.perf_counter() - self.t0
            return self.replayer.result()
        finally:
            self.close()

    def close(self) -> None:
        if self.replayer is not None:
            self.replayer.close()
            self.replayer = None
        if self.harness is not None:
            harness, self.harness = self.harness, None
            harness.shutdown()


def serve(conn: Any) -> None:
    """The node process: answer the coordinator's messages until ``stop``."""
    # The coordinator prints the table; the nodes' vLLM says only what is wrong.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    node = _Node()
    try:
        while True:
            try:
                op, arg = conn.recv()
            except EOFError:  # the coordinator is gone
                return
            if op == "stop":
                return
            try:
                value = {"start": node.start, "request": node.request,
                         "calibrate": node.calibrate,
                         "finish": lambda _: node.finish()}[op](arg)
            except Exception:
                node.close()
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", value))
    finally:
        node.close()
