#!/usr/bin/env bash
# One-GPU optimizer-step check on GPT-2 XL matrix shapes (issue 12 item 4), at most 5 minutes.
#
#   scripts/gpu_check.sh                 # on a CUDA machine; writes $OUT (if set) or ./gpu_out
#   scripts/gpu_check.sh --cpu-smoke     # the same code on CPU, tiny shapes, seconds (tested in CI)
#
# Dobb B=16 T=9 amortized against torch AdamW (fused), torch.optim.Muon and Dion rho=1/16, Dobb's
# non-refresh step replayed from a CUDA graph, state and peak memory against the derived bytes, and
# each step's fraction of the roofline bound measured on the same GPU (scripts/gpu_check.py).
# Stage 1 runs the first 4 layers (a table even if stage 2 runs out of time or memory); stage 2 all
# 48. Runs from a source checkout: PYTHONPATH=src, needs only torch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_out}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
start=$(date +%s)
status=0
{
  echo "== gpu_check $(date -u +%FT%TZ) $*"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
} 2>&1 | tee "$LOG"

stage() {  # stage <timeout s> <name> <args...>
  local limit=$1 name=$2; shift 2
  echo "== $name: timeout ${limit}s: python scripts/gpu_check.py $*" | tee -a "$LOG"
  timeout --signal=INT --kill-after=10 "$limit" python scripts/gpu_check.py "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s total" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

if [ "${1:-}" = "--cpu-smoke" ]; then
  stage 600 "cpu smoke" --cpu-smoke --cycles 1 --slow-steps 1 --out "$OUT_DIR/smoke"
else
  stage 90 "stage 1 (layers 0:4)" --layers 0:4 --cycles 3 --out "$OUT_DIR/xl_4layers"
  stage 190 "stage 2 (48 layers)" --cycles 2 --slow-steps 2 --out "$OUT_DIR/xl"
fi
echo "== done in $(( $(date +%s) - start )) s, status $status; tables: $OUT_DIR/*/gpu_check.md" | tee -a "$LOG"
exit $status
