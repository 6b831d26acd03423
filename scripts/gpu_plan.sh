#!/usr/bin/env bash
# The GPU work, as jobs packed into one command of at most ten minutes on a fresh GPU
# machine; docs/STATUS.md says what each is for.
#
#   scripts/gpu_plan.sh PLAN LOG_DIR
#
# PLAN is a list of stages separated by "+", run one after the other; a stage is a list of
# jobs separated by ",", run side by side; a job is NAME[@GPU][:SECONDS]: GPU sets
# CUDA_VISIBLE_DEVICES for that job alone, SECONDS caps its time. Jobs:
#
#   correctness   tests/test_gpu.py, test_andrea_clip.py and test_scale_call.py (or the
#                 pytest arguments in CORRECTNESS_TESTS), then memcheck and racecheck
#   bench         benchmarks/bench_clip.py (extra arguments in BENCH_ARGS, or in
#                 BENCH_ARGS_<GPU> for the job on that GPU; " ; " between two argument
#                 lists runs the script once for each, one after the other)
#   sharded       tests/test_sharded.py, then benchmarks/bench_sharded.py (two GPUs)
#   equivalence   the fallback-vs-CUDA experiment with its control run
#   timing        the clip-timing experiment
#
# For example, on two GPUs:
#   scripts/gpu_plan.sh correctness@0,bench@1 logs
#   BENCH_ARGS="--models gpt12m" scripts/gpu_plan.sh sharded:300+bench@0,equivalence@1 logs
#
# The plan builds first, gives every job a time limit that ends before DEADLINE seconds
# (default 560), stops waiting at DEADLINE whatever still runs, and packs LOG_DIR into
# LOG_DIR.tar.gz, so that a plan cut short still leaves its logs. It never kills by
# pattern: a `pkill -f` can match the shell that runs the plan. DRY_RUN=1 prints the jobs'
# commands instead of running them (and builds nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 PLAN LOG_DIR   (PLAN: stages joined by +, jobs by , ; job: NAME[@GPU])"
plan=${1:?$usage}
logs=${2:?$usage}
DEADLINE=${DEADLINE:-560}
PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHON=$PY
mkdir -p "$logs"

JOB_END=$DEADLINE  # each job's own end: DEADLINE, or sooner when the job has a cap
left() { echo $(( JOB_END - SECONDS > 10 ? JOB_END - SECONDS : 10 )); }
run() {  # run a command, or print it to the job's log under DRY_RUN
  if [[ $DRY_RUN == 1 ]]; then echo "  $*" >&3; else "$@"; fi
}

job_correctness() {  # $1: log folder
  # --timeout needs pytest-timeout (installed on the GPU machine).
  STAGES=test LOG_DIR="$1/test" GPU_TESTS="-p no:cacheprovider -ra --timeout=400 \
    --durations=25 ${CORRECTNESS_TESTS:-tests/test_gpu.py tests/test_andrea_clip.py tests/test_scale_call.py}" \
    run timeout "$(( $(left) - 120 ))" bash scripts/gpu_check.sh > "$1/test.out" 2>&1
  local rc=$?
  STAGES=sanitize LOG_DIR="$1/sanitize" run timeout "$(left)" bash scripts/gpu_check.sh \
    > "$1/sanitize.out" 2>&1 || rc=1
  grep -h -A4 "gpu_check summary" "$1/test.out" "$1/sanitize.out"
  return $rc
}
job_bench() {  # arguments: BENCH_ARGS_<GPU> for the job on that GPU, else BENCH_ARGS;
  # " ; " separates several runs one after the other (bench.json, bench-2.json, ...)
  local own="BENCH_ARGS_${CUDA_VISIBLE_DEVICES:-}" rc=0 i=0 part
  local all=${!own:-${BENCH_ARGS:-}}
  while :; do
    part=${all%% ; *}
    i=$(( i + 1 )); local suffix=""; (( i > 1 )) && suffix="-$i"
    local start=$(( $(left) - 100 )); (( start < 1 )) && start=1  # 0 would mean no limit
    # shellcheck disable=SC2086  # a list of arguments
    run timeout "$(left)" $PY benchmarks/bench_clip.py --no-probe \
      --max-seconds "$start" --out "$1/bench$suffix.json" $part \
      > "$1/bench$suffix.log" 2>&1 || rc=1
    tail -n 45 "$1/bench$suffix.log"
    [[ $all == *" ; "* ]] || break
    all=${all#* ; }
  done
  return $rc
}
job_sharded() {
  run timeout "$(( $(left) < 200 ? $(left) : 200 ))" $PY -m pytest -q -ra \
    -p no:cacheprovider tests/test_sharded.py > "$1/sharded_tests.log" 2>&1
  local rc=$?
  run timeout "$(left)" $PY benchmarks/bench_sharded.py --dtypes f32,bf16 \
    --max-seconds "$(( $(left) - 60 ))" --out "$1/sharded.json" > "$1/sharded.log" 2>&1 \
    || rc=1
  tail -n 3 "$1/sharded_tests.log"; tail -n 25 "$1/sharded.log"; return $rc
}
job_equivalence() {
  run timeout "$(left)" bash scripts/gpu_experiments.sh equivalence "$1/equivalence" \
    > "$1/equivalence.out" 2>&1
}
job_timing() {
  run timeout "$(left)" bash scripts/gpu_experiments.sh timing "$1/timing" \
    > "$1/timing.out" 2>&1
}

# Check the whole plan before anything runs.
IFS=+ read -ra stages <<< "$plan"
for stage in "${stages[@]}"; do
  IFS=, read -ra jobs_ <<< "$stage"
  for job in "${jobs_[@]}"; do
    [[ $job =~ ^([a-z]+)(@[0-9]+)?(:[0-9]+)?$ ]] || { echo "bad job '$job'" >&2; echo "$usage" >&2; exit 2; }
    declare -F "job_${BASH_REMATCH[1]}" > /dev/null \
      || { echo "unknown job '${BASH_REMATCH[1]}' in '$plan'" >&2; echo "$usage" >&2; exit 2; }
  done
done

finish() {
  local rc=$?
  echo "t=${SECONDS}s: packing $logs (exit $rc)"
  tar czf "$logs.tar.gz" -C "$logs" . 2>/dev/null
  exit $rc
}
trap finish EXIT

if [[ $DRY_RUN != 1 ]]; then
  STAGES=build LOG_DIR="$logs/build" bash scripts/gpu_check.sh > "$logs/build.out" 2>&1 \
    || { tail -n 40 "$logs/build.out"; exit 1; }
fi

failed=0
for stage in "${stages[@]}"; do
  IFS=, read -ra jobs_ <<< "$stage"
  pids=() names=() dirs=()
  for job in "${jobs_[@]}"; do
    [[ $job =~ ^([a-z]+)(@([0-9]+))?(:([0-9]+))?$ ]]
    name=${BASH_REMATCH[1]} gpu=${BASH_REMATCH[3]} cap=${BASH_REMATCH[5]:-$DEADLINE}
    dir="$logs/$name${gpu:+-gpu$gpu}"
    mkdir -p "$dir"
    echo "t=${SECONDS}s: $job"
    (
      exec 3>&1
      [[ -n $gpu ]] && export CUDA_VISIBLE_DEVICES=$gpu
      JOB_END=$(( SECONDS + cap < DEADLINE ? SECONDS + cap : DEADLINE ))
      "job_$name" "$dir"
    ) > "$dir/job.out" 2>&1 &
    pids+=($!) names+=("$job") dirs+=("$dir")
  done
  for i in "${!pids[@]}"; do  # wait for each job, at most until DEADLINE
    while kill -0 "${pids[$i]}" 2> /dev/null && (( SECONDS < DEADLINE )); do sleep 2; done
    if kill -0 "${pids[$i]}" 2> /dev/null; then
      echo "t=${SECONDS}s: ${names[$i]} still running at the deadline"; failed=1
    else
      wait "${pids[$i]}" || { echo "t=${SECONDS}s: ${names[$i]} failed"; failed=1; }
    fi
    cat "${dirs[$i]}/job.out"
  done
done
exit "$failed"
