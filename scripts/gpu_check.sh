#!/usr/bin/env bash
# One-GPU optimizer-call timing on GPT-2 XL matrix shapes (paper Tables 5 and 23), < 5 minutes.
#
#   scripts/gpu_check.sh            # on a CUDA machine; tables land in $OUT (if set) or ./gpu_out
#
# Stage 1: the first 4 layers (24 matrices), 5 repeats: a quick table that exists even if stage 2
#          runs out of time or memory.
# Stage 2: all 48 layers (288 matrices, 1.47B entries, fp32), repeats until a 60 s measurement
#          budget is spent (at least 2).
# Both: torch AdamW (foreach; the reference), torch.optim.Muon, Dion rho=1/16 and 1/4, Dobb B=16
# T=9 with and without staggered refresh; Dobb with check_finite=False; optimizer.step() only.
# Stage 3: the derived payload table of Figure 1 (no GPU needed).
#
# Overrides (used to check the script on CPU): GPU_CHECK_DEVICE (cuda), GPU_CHECK_PRESET (xl),
# GPU_CHECK_LAYERS (all), GPU_CHECK_QUICK_LAYERS (4), GPU_CHECK_BUDGET (60 seconds),
# GPU_CHECK_OPTIMIZERS (space-separated specs).
# Runs from a source checkout without installing: PYTHONPATH=src, and only dobb_bench.timing's own
# imports (torch; matplotlib optional for the PNG).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_out}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
PRESET="${GPU_CHECK_PRESET:-xl}"
LAYERS="${GPU_CHECK_LAYERS:-all}"
QUICK_LAYERS="${GPU_CHECK_QUICK_LAYERS:-4}"
BUDGET="${GPU_CHECK_BUDGET:-60}"
OPTIMIZERS="${GPU_CHECK_OPTIMIZERS:-torch-adamw torch-muon dion:rank_fraction=1/16 dion:rank_fraction=1/4 dobb dobb:stagger=true}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
start=$(date +%s)
status=0

{
  echo "== gpu_check $(date -u +%FT%TZ) device=$DEVICE preset=$PRESET layers=$LAYERS budget=${BUDGET}s"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
} 2>&1 | tee "$LOG"

run() {  # run <timeout seconds> <name> <args...>
  local limit=$1 name=$2; shift 2
  echo "== $name: timeout ${limit}s: python -m dobb_bench.timing $*" | tee -a "$LOG"
  timeout --signal=INT --kill-after=10 "$limit" python -m dobb_bench.timing "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s total" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

# shellcheck disable=SC2086
run 70 "stage 1 (layers $QUICK_LAYERS)" timing --preset "$PRESET" --layers "$QUICK_LAYERS" --device "$DEVICE" \
  --repeats 5 --optimizers $OPTIMIZERS --out "$OUT_DIR/timing_${PRESET}_quick"
# shellcheck disable=SC2086
run 200 "stage 2 (layers $LAYERS)" timing --preset "$PRESET" --layers "$LAYERS" --device "$DEVICE" \
  --repeats 20 --time-budget "$BUDGET" --optimizers $OPTIMIZERS --out "$OUT_DIR/timing_${PRESET}"
run 15 "stage 3 (payload)" payload --preset "$PRESET" --out "$OUT_DIR/payload_${PRESET}"

echo "== done in $(( $(date +%s) - start )) s, status $status; tables: $OUT_DIR/*/timing.md" | tee -a "$LOG"
exit $status
