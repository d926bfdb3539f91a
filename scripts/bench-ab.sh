#!/usr/bin/env bash
# A/B two checkouts with `kvstore-tiers bench`, in one run: whole bench
# processes alternate, PYTHONPATH at one checkout then the other, the order
# swapped every round (A B, B A, ...: the position in a round counts), all from
# the current directory (same disk, same --dir). Then `bench --compare` (with
# checkout B's code) prints B/A per figure, balanced over AB/BA round pairs.
#
#   bash scripts/bench-ab.sh A_CHECKOUT B_CHECKOUT ROUNDS [bench options...]
#   bash scripts/bench-ab.sh ../old-main . 4 --tier fs --tier redis --tier s3 \
#       --samples ../shared/data/kv-samples --rounds 2
#
# Each checkout needs its C extension built in place first
# (`python setup.py build_ext --inplace`). Results: $KVSTORE_AB_OUT (bench-ab).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 3 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
A="$(cd "$1" && pwd)"; B="$(cd "$2" && pwd)"; ROUNDS="$3"; shift 3
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$(mkdir -p "${KVSTORE_AB_OUT:-bench-ab}" && cd "${KVSTORE_AB_OUT:-bench-ab}" && pwd)"
bench() {  # bench CHECKOUT ARGS...: the CLI with that checkout's code first on the path
    local code="$1"; shift
    # `python -c` puts the current directory first on the path, where a
    # checkout would shadow PYTHONPATH's: drop it (python -P needs 3.11).
    PYTHONPATH="$code" "$PY" -c 'import sys; del sys.path[0]; from kvstore_tiers.cli import main; sys.argv[0] = "kvstore-tiers"; main()' bench "$@"
}
for ((i = 1; i <= ROUNDS; i++)); do
    if ((i % 2)); then order="A B"; else order="B A"; fi
    for side in $order; do
        code="$A"; [ "$side" = B ] && code="$B"
        echo "== round $i/$ROUNDS: $side ($code)"
        bench "$code" "$@" --no-plots --out "$OUT/$i-$side"
    done
done
bench "$B" --compare "$OUT"
