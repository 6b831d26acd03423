#!/usr/bin/env bash
# The example's experiments on a GPU (examples/experiments/exp_*.py), with a wall-clock budget.
#
#   scripts/gpu_experiments.sh v1v2-12m OUT_DIR   # andrea-12m v1 and v2, side by side
#   scripts/gpu_experiments.sh v1v2-120m OUT_DIR  # andrea-120m v1, v2, v2-per-tensor
#   scripts/gpu_experiments.sh v1v2-report OUT_DIR  # the report over every run in OUT_DIR
#   scripts/gpu_experiments.sh equivalence OUT_DIR  # pure-JAX clip vs the custom call
#   scripts/gpu_experiments.sh timing OUT_DIR       # their step and clip times
#
# The v1v2 modes train their runs side by side on the visible GPU (pick it with
# CUDA_VISIBLE_DEVICES), each ending, with its samples and summary, once
# EXPERIMENT_SECONDS have passed (train_gpt's --time-limit-s); report.md gives each
# run's steps. Runs that share a GPU have meaningless tokens/s: these experiments are
# about norms, losses and samples. `equivalence` compares the two clips step by step,
# with a second pure-JAX run as the control (its runs are not time-limited: all must make
# the same steps). `timing` must run
# alone on its GPU, since it measures.
#
# Settings (environment): EXPERIMENT_SECONDS (default 420), STEPS_12M (3000),
# STEPS_120M (2000), WARMUP_12M (300), WARMUP_120M (200), EQUIV_STEPS (1000),
# EQUIV_IMPLS (jax,ffi,jax), PYTHON,
# and EXTRA_ARGS (passed to every run; e.g. a smaller batch for a smoke test on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 v1v2-12m|v1v2-120m|v1v2-report|equivalence|timing OUT_DIR"
what=${1:?$usage}
out=${2:?$usage}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$out"
codes="$out/exit-codes-$what.txt"
: > "$codes"

v1v2() {  # log name, then the arguments of exp_v1_vs_v2.py
  local name=$1; shift
  $PY examples/experiments/exp_v1_vs_v2.py --out-dir "$out" --no-progress \
    --time-limit-s "${EXPERIMENT_SECONDS:-420}" --cache-dir "$out/.cache-$name" \
    ${EXTRA_ARGS:-} "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?" >> "$codes"
  rm -rf "$out/.cache-$name"
}

case "$what" in
  v1v2-12m)
    s=${STEPS_12M:-3000}
    v1v2 12m-v1 --configs andrea-12m --variants v1 --per-tensor-configs '' --steps "$s" &
    v1v2 12m-v2 --configs andrea-12m --variants v2 --per-tensor-configs '' --steps "$s" \
      --warmup-steps "${WARMUP_12M:-300}" &
    wait ;;
  v1v2-120m)
    s=${STEPS_120M:-2000}; w=${WARMUP_120M:-200}
    v1v2 120m-v1 --configs andrea-120m --variants v1 --per-tensor-configs '' --steps "$s" &
    v1v2 120m-v2 --configs andrea-120m --variants v2 --per-tensor-configs '' --steps "$s" \
      --warmup-steps "$w" &
    v1v2 120m-pt --configs andrea-120m --variants '' --per-tensor-configs andrea-120m \
      --steps "$s" --warmup-steps "$w" &
    wait ;;
  v1v2-report)
    $PY examples/experiments/exp_v1_vs_v2.py --report-only --out-dir "$out" > "$out/report.log" 2>&1
    echo "report: exit $?" >> "$codes" ;;
  equivalence)
    $PY examples/experiments/exp_fallback_vs_cuda.py --configs andrea-12m --steps "${EQUIV_STEPS:-1000}" \
      --clip-impls "${EQUIV_IMPLS:-jax,ffi,jax}" --time-configs '' --out-dir "$out" \
      --no-progress ${EXTRA_ARGS:-} > "$out/equivalence.log" 2>&1
    echo "equivalence: exit $?" >> "$codes" ;;
  timing)
    $PY examples/experiments/exp_fallback_vs_cuda.py --configs '' --time-configs andrea-12m,andrea-120m \
      --out-dir "$out" --no-progress ${EXTRA_ARGS:-} > "$out/timing.log" 2>&1
    echo "timing: exit $?" >> "$codes" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
cat "$codes"
! grep -qv "exit 0$" "$codes"
