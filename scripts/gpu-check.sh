#!/usr/bin/env bash
# One prepared check of the torch engine on a CUDA GPU (sized for an H200), inside 10 minutes:
#   1. the GPU reference tests (pytest -m gpu: every family on CUDA in bfloat16 and float32,
#      chunked with prefix reuse, against transformers' float32 forward);
#   2. the engine's tokens/s against one monolithic transformers forward of the same model,
#      side by side, bfloat16, with the per-part profile (benchmarks/engine_vs_hf.py), eager
#      and with the torch.compile switch;
#   3. a 2-stage pipeline (LocalPipeline: stage processes on the one GPU, NATS, activations
#      through host memory) against the same transformers forward, bfloat16, with each
#      stage's loop profile (receive, engine pass, send, plan handling, the rest);
#   4. the cost model fitted on the GPU (wavepp calibrate --device cuda).
# Each step has its own time limit (their sum is 600 s); a failed step is reported and the
# others still run; the exit status is the number of failed steps. Outputs go to $OUT
# (default ./gpu-check-out). Without a CUDA device it stops with exit 1 before any step.
#
#   scripts/gpu-check.sh                   run on cuda
#   scripts/gpu-check.sh --dry-run         print the steps, run nothing
#   scripts/gpu-check.sh --cpu             the same steps on the CPU at toy sizes (checks the script)
#   scripts/gpu-check.sh [...] --only STEP that step only (a name --dry-run prints)
set -u -o pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 [--dry-run | --cpu] [--only STEP]" >&2; exit 2; }
mode=cuda
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) mode=dry ;;
    --cpu) mode=cpu ;;
    --only) [ $# -ge 2 ] || usage; only=$2; shift ;;
    *) usage ;;
  esac
  shift
done

OUT="${OUT:-gpu-check-out}"
PY="${PYTHON:-python}"
# NOTE: --cpu checks the script, not a speed: its limits are the GPU's times 4 (a loaded CPU).
if [ "$mode" = cpu ]; then
  device=cpu dtype=float32 requests=2 batch=2 threads=2 repeats=1 cal_repeats=1 scale=4
  pipe_requests=4
else
  device=cuda dtype=bfloat16 requests=120 batch=8 threads=16 repeats=2 cal_repeats=3 scale=1
  pipe_requests=40
fi
bench=("$PY" benchmarks/engine_vs_hf.py --device "$device" --dtype "$dtype"
  --requests "$requests" --batch "$batch" --chunk-tokens 2048 --threads "$threads"
  --repeats "$repeats" --profile --json)
pipeline=("$PY" benchmarks/engine_vs_hf.py --device "$device" --dtype "$dtype" --stages 2
  --requests "$pipe_requests" --concurrency 8 --threads "$threads"
  --repeats 1 --profile --json)
gpu_tests="$PY -m pytest -q -p no:cacheprovider -m gpu tests/runtime/stage"
if [ "$mode" != cpu ]; then
  # on a GPU a skipped GPU test is a failed check (pytest's -ra summary lists each skip)
  gpu_tests="$gpu_tests && ! grep -q '^SKIPPED' '$OUT/gpu-tests.log'"
fi
steps=(
  "gpu-tests|180|$gpu_tests"
  "engine-vs-hf|120|${bench[*]}"
  "engine-vs-hf-compiled|120|${bench[*]} --compile"
  "pipeline-vs-hf|90|${pipeline[*]}"
  "calibrate|90|$PY -m wavepp.cli calibrate --device $device --repeats $cal_repeats --out $OUT/cost-model-$device.json"
)

if [ -n "$only" ]; then
  kept=()
  for step in "${steps[@]}"; do
    [ "${step%%|*}" = "$only" ] && kept+=("$step")
  done
  [ ${#kept[@]} -gt 0 ] || { echo "--only $only: not a step" >&2; usage; }
  steps=("${kept[@]}")
fi

if [ "$mode" = dry ]; then
  for step in "${steps[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    echo "$name (limit ${limit}s): $command"
  done
  exit 0
fi

mkdir -p "$OUT"
if [ "$mode" = cuda ]; then
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))' \
    | tee "$OUT/device.txt" || exit 1
  nvidia-smi >>"$OUT/device.txt" 2>&1 || true
fi
failed=0
for step in "${steps[@]}"; do
  IFS='|' read -r name limit command <<<"$step"
  echo "== $name (limit ${limit}s): $command"
  began=$(date +%s)
  timeout "$((limit * scale))" bash -c "$command" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   rc=$rc in $(( $(date +%s) - began ))s; tail of $OUT/$name.log:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   | /'
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
done
echo "== $failed step(s) failed; outputs in $OUT"
exit "$failed"
