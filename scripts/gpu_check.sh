#!/usr/bin/env bash
# The GPU run: on the H100 set up as ../shared/gpu/README.md says, run the whole
# test suite (GPU tests included), the p22 solution at the default and a
# realistic size, and the dispatch benchmark. Every report goes to results/
# (or the folder given as $1), stamped with the GPU name and commit; commit them.
#
#   . /opt/maxsite/env.sh && bash scripts/gpu_check.sh [out_dir]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OPS_CACHE_DIR="${OPS_CACHE_DIR:-/tmp/ops_cache}"
status=0
export OPS_COMMIT="${OPS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
stamp() { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit $OPS_COMMIT, $(date -u +%F)"; }
run() {  # run <report name> <command...>: tee the output into $out/<name>.txt, remember failures
  local name="$1"; shift
  { stamp; echo "\$ $*"; "$@"; } 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "exit code: $rc" | tee -a "$out/$name.txt"
  [ "$rc" -eq 0 ] || status=1
}
run gpu_tests python -m pytest -q -rs -p no:cacheprovider tests
run p22_default python scripts/p22.py --solution --unfused --fused
run p22_realistic python scripts/p22.py --solution --unfused --fused --batch 8 --seq 512 --hidden 768 --out 3072 --iters 100
run p22_realistic_naive python scripts/p22.py --solution --fused --variant naive --batch 8 --seq 512 --hidden 768 --out 3072 --iters 5
run bench_dispatch_log python scripts/bench_dispatch.py
cp results/bench_dispatch.md results/bench_dispatch.csv "$out"/ 2>/dev/null || true
exit $status
