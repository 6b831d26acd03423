#!/usr/bin/env bash
# GPU jobs packed into one command that ends within DEADLINE seconds (default 560) and
# always leaves its logs, packed into LOG_DIR.tar.gz.
#
#   scripts/gpu_plan.sh PLAN LOG_DIR
#
# PLAN: stages joined by "+", run one after the other; a stage: jobs joined by ",", run side
# by side; a job: NAME[@GPU][:SECONDS], where GPU sets CUDA_VISIBLE_DEVICES for that job
# and SECONDS caps it. Jobs:
#   correctness  the GPU tests (pytest arguments in CORRECTNESS_TESTS), then memcheck and
#                racecheck (scripts/gpu_check.sh)
#   bench        benchmarks/bench_clip.py with BENCH_ARGS (BENCH_ARGS_<GPU> for the job
#                pinned to that GPU)
#   sharded      tests/test_sharded.py, then benchmarks/bench_sharded.py with SHARDED_ARGS
#                (every visible GPU)
# For example, on two GPUs:
#   BENCH_ARGS_0="--models gpt120m" BENCH_ARGS_1="--models gpt12m" \
#     scripts/gpu_plan.sh bench@0,bench@1 logs
#   scripts/gpu_plan.sh sharded:300+correctness@0,bench@1 logs
#
# It builds first, gives each job a `timeout` that ends by its cap or the deadline, and
# waits on the jobs by their process ids: it never kills by pattern (a `pkill -f` would
# match the shell that runs the plan itself).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 PLAN LOG_DIR   (PLAN: stages joined by +, jobs by , ; job: NAME[@GPU][:SECONDS])"
plan=${1:?$usage}
logs=${2:?$usage}
DEADLINE=${DEADLINE:-560}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHON=$PY
JOB_RE='^(correctness|bench|sharded)(@([0-9]+))?(:([0-9]+))?$'

left() { echo $(( JOB_END - SECONDS > 10 ? JOB_END - SECONDS : 10 )); }

job_correctness() {  # $1: log folder; the sanitizers get the last 120 s
  STAGES=test LOG_DIR="$1/test" GPU_TESTS="-v -ra --durations=25 \
    ${CORRECTNESS_TESTS:-tests/test_gpu.py tests/test_andrea_clip.py tests/test_scale_call.py}" \
    timeout "$(( $(left) - 120 ))" bash scripts/gpu_check.sh > "$1/test.out" 2>&1
  local rc=$?
  STAGES=sanitize LOG_DIR="$1/sanitize" timeout "$(left)" bash scripts/gpu_check.sh \
    > "$1/sanitize.out" 2>&1 || rc=1
  grep -h -A4 "gpu_check summary" "$1/test.out" "$1/sanitize.out"
  return $rc
}
job_bench() {  # the benchmark starts no new case in its last 100 s
  local own="BENCH_ARGS_${CUDA_VISIBLE_DEVICES:-}"
  # shellcheck disable=SC2086  # a list of arguments
  timeout "$(left)" $PY benchmarks/bench_clip.py --max-seconds "$(( $(left) - 100 ))" \
    --out "$1/bench.json" ${!own:-${BENCH_ARGS:-}} > "$1/bench.log" 2>&1
  local rc=$?
  tail -n 45 "$1/bench.log"
  return $rc
}
job_sharded() {
  timeout "$(( $(left) < 200 ? $(left) : 200 ))" $PY -m pytest -q -ra tests/test_sharded.py \
    > "$1/sharded_tests.log" 2>&1
  local rc=$?
  # shellcheck disable=SC2086  # a list of arguments
  timeout "$(left)" $PY benchmarks/bench_sharded.py --max-seconds "$(( $(left) - 90 ))" \
    --out "$1/sharded.json" ${SHARDED_ARGS:-} > "$1/sharded.log" 2>&1 || rc=1
  tail -n 3 "$1/sharded_tests.log"; tail -n 30 "$1/sharded.log"
  return $rc
}

IFS=+ read -ra stages <<< "$plan"
for stage in "${stages[@]}"; do  # the whole plan is checked before anything runs
  IFS=, read -ra jobs <<< "$stage"
  for job in "${jobs[@]}"; do
    [[ $job =~ $JOB_RE ]] || { echo "bad job '$job'" >&2; echo "$usage" >&2; exit 2; }
  done
done

mkdir -p "$logs"
trap 'rc=$?; echo "t=${SECONDS}s: packing $logs"; tar czf "$logs.tar.gz" -C "$logs" .; exit $rc' EXIT
STAGES=build LOG_DIR="$logs/build" bash scripts/gpu_check.sh > "$logs/build.out" 2>&1 \
  || { tail -n 40 "$logs/build.out"; exit 1; }

failed=0
for stage in "${stages[@]}"; do
  IFS=, read -ra jobs <<< "$stage"
  pids=() dirs=()
  for job in "${jobs[@]}"; do
    [[ $job =~ $JOB_RE ]]
    name=${BASH_REMATCH[1]} gpu=${BASH_REMATCH[3]} cap=${BASH_REMATCH[5]:-$DEADLINE}
    dir="$logs/$name${gpu:+-gpu$gpu}"
    mkdir -p "$dir"
    echo "t=${SECONDS}s: $job"
    (
      [[ -n $gpu ]] && export CUDA_VISIBLE_DEVICES=$gpu
      JOB_END=$(( SECONDS + cap < DEADLINE ? SECONDS + cap : DEADLINE ))
      "job_$name" "$dir"
    ) > "$dir/job.out" 2>&1 &
    pids+=($!) dirs+=("$dir")
  done
  for i in "${!pids[@]}"; do  # each job, waited on by its id until the deadline
    while kill -0 "${pids[$i]}" 2> /dev/null && (( SECONDS < DEADLINE )); do sleep 2; done
    if kill -0 "${pids[$i]}" 2> /dev/null; then
      echo "t=${SECONDS}s: ${jobs[$i]} still running at the deadline"; failed=1
    else
      wait "${pids[$i]}" || { echo "t=${SECONDS}s: ${jobs[$i]} failed"; failed=1; }
    fi
    cat "${dirs[$i]}/job.out"
  done
done
exit "$failed"
