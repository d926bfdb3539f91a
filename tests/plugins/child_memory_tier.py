"""Child process of test_memory_plugin: run ONE scenario, print one JSON line.

Run as ``python child_memory_tier.py SCENARIO``, with or without the
kvstore-memory plugin on ``PYTHONPATH``. Everything goes through vLLM's real
``TieringOffloadingSpec`` -> ``TieringOffloadingManager`` ->
``SecondaryTierFactory`` (``kvstore_tiers.admin.harness``), exactly as in an engine.

Scenarios:

* ``roundtrip``: ``{"type": "memory"}`` -- store rows, make the primary
  forget them, look them up as a new request (RETRY -> HIT), promote, and
  compare the bytes in the primary with what was stored.
* ``unknown``: the same config in a process without the plugin; report the
  error of each route (registered name; ``module_path`` route).
* ``check``: ``kvstore-tiers check --config '{"type": "memory"}'``, as JSON
  and as text; report the exit codes, the JSON report and the text.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "


def roundtrip() -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult

    from kvstore_tiers.admin.harness import build_harness, make_keys
    from kvstore_tiers.registry import backend_names

    n, row_bytes = 8, 4096
    h = build_harness([{"type": "memory", "max_bytes": 1 << 20}], num_chunks=16,
                      chunk_bytes=row_bytes)
    try:
        tier = h.tiers[0]
        keys = make_keys(n, seed=7)
        rows = np.random.default_rng(7).integers(0, 256, (n, row_bytes), dtype=np.uint8)
        h.store_all(keys, rows)
        stored = len(list(tier.backend.iter_objects()))
        h.forget_primary()
        ctx2 = h.new_request()
        results, steps = h.lookup_until_resolved(keys, ctx2)
        loaded = h.load(keys, ctx2)
        h.finish_request(ctx2)
        return {
            "installed": backend_names(),
            "tier_class": f"{type(tier).__module__}.{type(tier).__qualname__}",
            "backend": f"{type(tier.backend).__module__}.{type(tier.backend).__qualname__}",
            "config_model": type(tier.config).__name__,
            "locality": str(tier.locality.value),
            "objects_stored": stored,
            "used_bytes": tier.backend.used_bytes,
            "lookups": [r.name for r in results],
            "all_hit": all(r == LookupResult.HIT for r in results),
            "steps": steps,
            "byte_exact": bool(np.array_equal(loaded, rows)),
        }
    finally:
        h.shutdown()


def unknown() -> dict[str, Any]:
    from kvstore_tiers.admin.harness import build_harness

    out: dict[str, Any] = {}
    routes = {
        "registered_name": {"type": "memory"},
        "module_path": {"type": "memory", "module_path": "kvstore_tiers.tiers"},
    }
    for route, cfg in routes.items():
        try:
            build_harness([cfg]).shutdown()
            out[route] = {"error": None}
        except Exception as exc:
            out[route] = {"error": type(exc).__name__, "message": str(exc)}
    return out


def check() -> dict[str, Any]:
    from click.testing import CliRunner

    from kvstore_tiers.cli import main as cli

    args = ["check", "--config", '{"type": "memory"}']
    as_json = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    as_text = CliRunner().invoke(cli, args, catch_exceptions=False)
    return {"json_exit": as_json.exit_code, "report": json.loads(as_json.stdout)[0],
            "text_exit": as_text.exit_code, "text": as_text.stdout}


def main() -> int:
    scenario = sys.argv[1]
    result = {"roundtrip": roundtrip, "unknown": unknown, "check": check}[scenario]()
    # vLLM logs to stdout too: mark our line so the parent can find it.
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
