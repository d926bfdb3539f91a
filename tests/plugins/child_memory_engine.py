"""Child process of test_memory_plugin_engine: a real vLLM engine with a memory tier.

One engine process (an in-memory tier does not outlive its process):
prompt A -> its chunks cascade to the memory tier -> prompt B evicts A's
chunks from the (deliberately small) CPU primary -> ``llm.reset_prefix_cache()``
empties the GPU prefix cache -> prompt A again, which can then only be
served from the memory tier. Prints one ``RESULT {json}`` line.

Usage: ``python child_memory_engine.py WORK_DIR`` with the plugin on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvstore_tiers.tier import STATS_DIR_ENV
from kvstore_tiers.tools.demo.models import tiny_llama_model_dir
from kvstore_tiers.tools.demo.phase import (
    EXTERNAL_HITS,
    TIER_READ_BYTES,
    TIER_WRITE_BYTES,
    _settle,
    _snapshot,
    build_llm,
    resolved_tier_classes,
)
from kvstore_tiers.tools.demo.prompts import PromptPlan, build_prompts

BLOCK = 128
#: Bytes of one 128-token chunk of the tiny model (float32), and a primary
#: that holds only a few: a second prompt then evicts the first one's chunks.
CHUNK_BYTES = 131072
PRIMARY_CHUNKS = 6


def main() -> int:
    from vllm import SamplingParams, TokensPrompt

    work = Path(sys.argv[1])
    model = tiny_llama_model_dir(work / "tiny-llama", seed=0)
    tiers = [{"type": "memory", "max_bytes": 64 << 20}]
    llm = build_llm({"model": str(model), "dtype": "float32", "single_process": True,
                     "block_size": BLOCK, "cpu_bytes": PRIMARY_CHUNKS * CHUNK_BYTES,
                     "secondary_tiers": tiers})
    # Two prompts with nothing in common (num_prompts=2, no shared prefix).
    ids, other = build_prompts(llm.get_tokenizer(),
                               PromptPlan(prefix_tokens=0, suffix_tokens=640, num_prompts=2))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    flush = [7 + (i % 5) for i in range(8)]

    def generate(prompt: list[int]) -> list[int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    first = generate(ids)
    _settle(llm, flush, 20.0)
    generate(other)  # its chunks push the first prompt's out of the small primary
    stored = _settle(llm, flush, 20.0)
    # And the GPU prefix cache forgets: the first prompt can now only come
    # from the memory tier.
    reset_ok = llm.reset_prefix_cache()
    before = _snapshot(llm)
    second = generate(ids)
    served = _snapshot(llm)
    # vLLM reports tier read bytes with the step's stats: step a little more.
    after = _settle(llm, flush, 20.0)
    result = {
        "tier_classes": resolved_tier_classes(tiers),
        "prompt_tokens": len(ids),
        "full_chunks": len(ids) // BLOCK,
        "write_bytes": stored.get(TIER_WRITE_BYTES, 0.0),
        "reset_ok": bool(reset_ok),
        "external_hit_tokens": int(served.get(EXTERNAL_HITS, 0) - before.get(EXTERNAL_HITS, 0)),
        "tier_read_bytes": int(after.get(TIER_READ_BYTES, 0) - before.get(TIER_READ_BYTES, 0)),
        "same_output": first == second,
    }
    llm.llm_engine.engine_core.shutdown()
    # Our tiers write their counters at shutdown (KVSTORE_TIERS_STATS_DIR).
    stats_dir = os.environ.get(STATS_DIR_ENV)
    result["tier_stats"] = [json.loads(p.read_text()) for p in sorted(
        Path(stats_dir).glob("*.json"))] if stats_dir else []
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
