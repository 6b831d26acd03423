#!/usr/bin/env bash
# On a CUDA machine: builds clipjax for sm_90, runs the GPU tests, the CUDA sanitizers over
# scripts/sanitize_kernels.py and (if asked) the benchmark, and prints a summary.
#
#   scripts/gpu_check.sh                     # build, test, sanitize
#   STAGES=build,test,bench scripts/gpu_check.sh
#   STAGES=memcheck scripts/gpu_check.sh     # stages: build test sanitize memcheck racecheck bench
#
# GPU_TESTS: pytest arguments, quoted as on a command line (-k "ffi or scale" stays one
# argument); BENCH_ARGS: arguments of benchmarks/bench_clip.py. Logs go to $LOG_DIR
# (default ./gpu_check_logs); the exit status is 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=${STAGES:-build,test,sanitize}
LOG_DIR=${LOG_DIR:-./gpu_check_logs}
PY=${PYTHON:-python3}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
declare -a SUMMARY=()
status=0

has() { [[ ",$STAGES," == *",$1,"* ]]; }
record() {  # name, exit code, log
  local verdict=PASS; [[ $2 -ne 0 ]] && { verdict="FAIL($2)"; status=1; }
  SUMMARY+=("$(printf '%-28s %-9s %s' "$1" "$verdict" "$3")")
}

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -n 2
  $PY -c "import jax, jaxlib, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__); print(jax.devices())"
} 2>&1 | tee "$LOG_DIR/env.txt"

if has build; then
  CUDAARCHS=90 $PY -m pip install --no-build-isolation --no-deps -v -e . \
    > "$LOG_DIR/build.log" 2>&1
  rc=$?
  grep -E "ptxas|registers|spill|warning" "$LOG_DIR/build.log" | head -40
  record build $rc build.log
  [[ $rc -ne 0 ]] && tail -40 "$LOG_DIR/build.log"
  $PY -c "import clipjax; print('ffi platforms:', clipjax.ffi_platforms())" 2>&1 | tee -a "$LOG_DIR/env.txt"
fi

if has test; then
  eval "tests=(${GPU_TESTS:-tests/test_gpu.py tests/test_andrea_clip.py tests/test_scale_call.py})"
  $PY -m pytest -q -ra "${tests[@]}" 2>&1 | tee "$LOG_DIR/pytest_gpu.log"
  record "pytest (GPU)" "${PIPESTATUS[0]}" pytest_gpu.log
fi

# The sanitizers run scripts/sanitize_kernels.py: the custom calls alone with host
# references, so that the kernels checked are clipjax's, not XLA's. The platform allocator
# gives every buffer its own cudaMalloc, so an access out of bounds is seen instead of
# landing inside XLA's arena. Each tool runs the script's groups of cases, one process each:
# over more cases in one process compute-sanitizer itself has crashed (SIGSEGV), with every
# case right and no error reported.
if has sanitize || has memcheck || has racecheck; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
  for tool in memcheck racecheck; do
    has sanitize || has $tool || continue
    extra=(); [[ $tool == memcheck ]] && extra=(--leak-check no)
    rc=0; : > "$LOG_DIR/$tool.log"
    mapfile -t groups < <($PY scripts/sanitize_kernels.py --groups)
    (( ${#groups[@]} )) || { echo "no groups of cases" >> "$LOG_DIR/$tool.log"; rc=1; }
    for group in "${groups[@]}"; do
      compute-sanitizer --tool $tool "${extra[@]}" --print-limit 20 --error-exitcode 9 \
        $PY scripts/sanitize_kernels.py "$group" >> "$LOG_DIR/$tool.log" 2>&1 || rc=$?
    done
    grep -E "SUMMARY|FAIL|all cases|SOME" "$LOG_DIR/$tool.log"
    record "compute-sanitizer $tool" $rc $tool.log
  done
  unset XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_ALLOCATOR
fi

if has bench; then
  # shellcheck disable=SC2086  # a list of arguments
  $PY benchmarks/bench_clip.py --out "$LOG_DIR/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench.log"
  record benchmark "${PIPESTATUS[0]}" bench.log
fi

echo
echo "== gpu_check summary =="
printf '%s\n' "${SUMMARY[@]}"
exit $status
