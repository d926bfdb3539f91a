"""One engine with a given tensor-parallel size, in its own process (run by
test_tensor_parallel.py): ``python child_tp_engine.py REQUEST.json RESULT.json``.

The demo phase runner has no tensor-parallel option; this is the smallest engine
run that has one: the tiny plan's prompts, greedy, results as JSON. Our tiers'
counters reach the parent through KVSTORE_TIERS_STATS_DIR (written at shutdown).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvstore_tiers.tools.demo.prompts import PromptPlan, build_prompts

    with open(sys.argv[1]) as f:
        request = json.load(f)
    tp = int(request["tp"])
    kwargs = {"model": request["model"], "dtype": "float32", "max_model_len": 4096,
              "enforce_eager": True, "seed": 0, "max_num_seqs": 4,
              "gpu_memory_utilization": 0.25, "tensor_parallel_size": tp,
              "distributed_executor_backend": "mp" if tp > 1 else "uni"}
    if request["tiers"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                          "cpu_bytes_to_use": 256 << 20, "block_size": 128,
                                          "secondary_tiers": request["tiers"]}}
    llm = LLM(**kwargs)
    prompts = build_prompts(llm.get_tokenizer(), PromptPlan(**request["plan"]))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = []
    for ids in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        for _ in range(6):  # a few engine steps: the stores of this prompt complete
            llm.generate([TokensPrompt(prompt_token_ids=[7, 8, 9])],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            time.sleep(0.2)
    with open(sys.argv[2], "w") as f:
        json.dump({"outputs": outputs}, f)
    del llm  # shuts the engine (and our tiers, which write their stats) down


if __name__ == "__main__":
    main()
