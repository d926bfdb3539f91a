#!/usr/bin/env bash
# Run the test suite: builds/refreshes the venv first (idempotent), then lint and pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
cd "$ROOT"
.venv/bin/ruff check kvstore_tiers tests plugins
exec .venv/bin/python -m pytest -q -ra "$@"
