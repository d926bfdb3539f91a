#!/usr/bin/env bash
# The main job: builds/refreshes the venv (idempotent), then runs the demo:
# a real vLLM engine on CPU offloading SmolLM2-135M's KV cache to the fs tier
# in ./kvstore-data, then a fresh engine served from it. Arguments go to
# `kvstore-tiers demo` (see --help), e.g. `bash scripts/demo.sh --tier redis`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
cd "$ROOT"
exec .venv/bin/kvstore-tiers demo "$@"
