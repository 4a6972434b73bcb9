#!/usr/bin/env bash
# The perf tooling's GPU runs (issue 6). Each step fits one device call (< 10 min) and calibrates
# first when this machine has no cached calibration yet. Results land in $OUT/results (or
# bench/results when OUT is unset); commit them from there.
#
#   bash bench/gpu_perf.sh calibrate   # ceilings -> cache + results/calibration-<gpu>.json
#   bash bench/gpu_perf.sh memory      # fusegraph bench --suite memory (eager, inductor, jax)
#   bash bench/gpu_perf.sh compute     # fusegraph bench --suite compute (+ max-autotune, cuDNN, jax)
#   bash bench/gpu_perf.sh validate    # what-if predicted vs measured per kernel, the whole suite
#   bash bench/gpu_perf.sh explain     # example HTML report + roofline PNG (bench/example_block.py)
set -euo pipefail
STEP=${1:-all}
RESULTS=${OUT:-bench}/results
mkdir -p "$RESULTS"
FG=${FUSEGRAPH:-fusegraph}
export FUSEGRAPH_CACHE_DIR=${FUSEGRAPH_CACHE_DIR:-/tmp/fusegraph-cache}

calibrate() {
  $FG calibrate | tee "$RESULTS/calibrate.txt"
  cp "$FUSEGRAPH_CACHE_DIR"/calibration/*.json "$RESULTS/" 2>/dev/null || true
}
ensure_calibrated() { ls "$FUSEGRAPH_CACHE_DIR"/calibration/*.json >/dev/null 2>&1 || calibrate; }

case "$STEP" in
  calibrate) calibrate ;;
  memory) ensure_calibrated; $FG bench --suite memory --compare eager,inductor,jax --out "$RESULTS" --no-progress ;;
  compute) ensure_calibrated; $FG bench --suite compute --compare eager,inductor,inductor-max,jax,cudnn \
             --out "$RESULTS" --no-progress ;;
  validate) ensure_calibrated; $FG whatif --validate --suite memory,compute | tee "$RESULTS/whatif_validation.txt" ;;
  explain) ensure_calibrated
           $FG explain bench/example_block.py --html "$RESULTS/example_report.html" --png "$RESULTS/roofline.png" \
             | tee "$RESULTS/example_explain.txt"
           $FG whatif bench/example_block.py --device B200 | tee "$RESULTS/example_whatif_B200.txt" ;;
  all) calibrate; for s in memory compute validate explain; do bash "$0" "$s"; done ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
