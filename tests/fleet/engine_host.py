"""One host of a fleet test that runs a real vLLM engine (``vllm.LLM``) over a shared tier.

Run inside the host's network namespace as ``python -m tests.fleet.engine_host
REQUEST`` (``REQUEST``: the JSON of a phase request of
:mod:`kvstore_tiers.tools.demo.phase`: the model, the prompt plan, the tiers;
the environment of :func:`kvstore_tiers.tools.demo.runner.phase_env`, engine
core and worker in this process). The engine is built as the e2e tests' phases
build theirs (:func:`kvstore_tiers.tools.demo.phase.build_llm`), so its greedy
outputs are comparable with a no-connector phase of the same model and prompts.

It serves every prompt once (computed, stored in the shared tier), then
prints ``{"event": "ready"}``, waits for ``go`` on stdin and serves the prompts
in turn until ``stop``. Before each request it drops everything the engine
holds locally (``reset_prefix_cache(reset_connector=True)``: vLLM's prefix
cache and the CPU tier, after draining the tier's jobs), so a request's prefix
comes from the shared tier or is recomputed, never from the engine's own
memory. It then prints one ``{"event": "report"}`` line: per request its
times (``time.monotonic()``, one clock for every process of the machine), its
output tokens, the tokens loaded from the tier, and the tier's circuit state
after it (``vllm:kvstore_circuit_state``: 0 closed, 1 half-open, 2 open), and its
counts of failed loads and dropped stores so far.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvstore_tiers.tools.demo.phase import (
    EXTERNAL_HITS,
    KVSTORE_PREFIX,
    _settle,
    _snapshot,
    build_llm,
)
from kvstore_tiers.tools.demo.prompts import PromptPlan, build_prompts
from tests.fleet.control import wait_for_go

CIRCUIT = f"{KVSTORE_PREFIX}circuit_state"
LOAD_FAILURES = f"{KVSTORE_PREFIX}load_failures"
STORES_DROPPED = f"{KVSTORE_PREFIX}stores_dropped"
#: A short prompt that matches nothing: stepping it submits deferred stores.
FLUSH = [7 + (i % 5) for i in range(8)]


class EngineHost:
    def __init__(self, request: dict[str, Any]) -> None:
        from vllm import SamplingParams

        self.llm = build_llm(request)
        self.prompts = build_prompts(self.llm.get_tokenizer(), PromptPlan(**request["plan"]))
        self.sp = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]))

    def serve(self, i: int) -> dict[str, Any]:
        """Prompt ``i`` (mod the count) with nothing held locally."""
        from vllm import TokensPrompt

        ids = self.prompts[i % len(self.prompts)]
        t0 = time.monotonic()
        self.llm.reset_prefix_cache(reset_connector=True)
        before = _snapshot(self.llm)
        t1 = time.monotonic()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], self.sp, use_tqdm=False)[0]
        t2 = time.monotonic()
        after = _snapshot(self.llm)
        return {
            "prompt": i % len(self.prompts), "t0": t0, "t1": t1, "t2": t2,
            "output_token_ids": list(out.outputs[0].token_ids),
            "external_hit_tokens": int(after.get(EXTERNAL_HITS, 0) - before.get(EXTERNAL_HITS, 0)),
            "circuit_state": int(after.get(CIRCUIT, 0)),
            "load_failures": int(after.get(LOAD_FAILURES, 0)),
            "stores_dropped": int(after.get(STORES_DROPPED, 0)),
        }

    def warm(self) -> list[dict[str, Any]]:
        """Each prompt computed and stored in the tier, the stores settled."""
        served = [self.serve(i) for i in range(len(self.prompts))]
        _settle(self.llm, FLUSH, 30.0)
        return served


def main() -> None:
    # vLLM logs to stdout: the protocol's lines get the original stdout to themselves,
    # and everything else written to fd 1 goes to stderr (the host's log)
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def say(event: dict[str, Any]) -> None:
        protocol.write(json.dumps(event) + "\n")

    request = json.loads(sys.argv[1])
    host = EngineHost(request)
    warm = host.warm()
    say({"event": "ready"})
    stop = wait_for_go()
    requests, i = [], 0
    while not stop.is_set():
        requests.append(host.serve(i))
        i += 1
    say({"event": "report", "warm": warm, "requests": requests})
    # the engine's own shutdown; the test stops this process by PID too
    host.llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
