#!/usr/bin/env bash
# The GPU work still to do, as three plans, each meant for one command of at most ten
# minutes on a fresh GPU machine; docs/STATUS.md says what each is for.
#
#   scripts/gpu_plan.sh correctness LOG_DIR   # one GPU: GPU tests alone, then sanitizers
#   scripts/gpu_plan.sh bench LOG_DIR         # one GPU: bench_clip.py, every case
#   scripts/gpu_plan.sh two-gpus LOG_DIR      # two GPUs: sharded tests and timing, then
#                                             # the experiments that are left, one per GPU
#
# Every plan builds first, runs its jobs with their own time limits, stops waiting at
# DEADLINE seconds (default 560) whatever still runs, and packs LOG_DIR into
# LOG_DIR.tar.gz, so that a plan cut short still leaves its logs. It never kills by
# pattern: a `pkill -f` can match the shell that runs the plan.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 correctness|bench|two-gpus LOG_DIR"
plan=${1:?$usage}
logs=${2:?$usage}
DEADLINE=${DEADLINE:-560}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHON=$PY
mkdir -p "$logs"
failed=0

wait_until() {  # wait for the background jobs, at most until second $1 of this script
  while [[ -n "$(jobs -rp)" ]] && (( SECONDS < $1 )); do sleep 2; done
}
left() { echo $(( DEADLINE - SECONDS > 10 ? DEADLINE - SECONDS : 10 )); }
finish() {
  local rc=$?
  echo "t=${SECONDS}s: packing $logs (exit $rc)"
  tar czf "$logs.tar.gz" -C "$logs" . 2>/dev/null
  exit $rc
}
trap finish EXIT

STAGES=build LOG_DIR="$logs/build" bash scripts/gpu_check.sh > "$logs/build.out" 2>&1 \
  || { tail -n 40 "$logs/build.out"; exit 1; }

case "$plan" in
  correctness)
    # --timeout needs pytest-timeout (installed on the GPU machine).
    STAGES=test LOG_DIR="$logs/test" GPU_TESTS="-p no:cacheprovider -ra --timeout=400 \
      tests/test_gpu.py tests/test_andrea_clip.py" timeout "$(( $(left) - 150 ))" \
      bash scripts/gpu_check.sh > "$logs/test.out" 2>&1 || failed=1
    STAGES=sanitize LOG_DIR="$logs/sanitize" timeout "$(left)" bash scripts/gpu_check.sh \
      > "$logs/sanitize.out" 2>&1 || failed=1
    grep -h -A4 "gpu_check summary" "$logs"/test.out "$logs"/sanitize.out ;;
  bench)
    timeout "$(left)" $PY benchmarks/bench_clip.py --no-probe \
      --max-seconds "$(( $(left) - 90 ))" --out "$logs/bench.json" > "$logs/bench.log" 2>&1 \
      || failed=1
    tail -n 40 "$logs/bench.log" ;;
  two-gpus)
    timeout 200 $PY -m pytest -q -ra -p no:cacheprovider tests/test_sharded.py \
      > "$logs/sharded_tests.log" 2>&1 || failed=1
    timeout 240 $PY benchmarks/bench_sharded.py --dtypes f32,bf16 --max-seconds 150 \
      --out "$logs/sharded.json" > "$logs/sharded.log" 2>&1 || failed=1
    CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_experiments.sh equivalence "$logs/equivalence" \
      > "$logs/equivalence.out" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 bash scripts/gpu_experiments.sh timing "$logs/timing" \
      > "$logs/timing.out" 2>&1 &
    wait_until "$DEADLINE"
    tail -n 3 "$logs/sharded_tests.log"; tail -n 20 "$logs/sharded.log" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
exit "$failed"
