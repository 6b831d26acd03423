#!/usr/bin/env bash
# Compiles the CUDA kernels with each CUDA 13 compiler that PyPI offers (nvidia-cuda-nvcc
# and the nvvm, crt, runtime and cccl packages of the same release), for every default
# architecture, with ptxas spill warnings as errors: the kernels must build, and never
# spill, with any compiler a user's `pip install` may fetch. With CUDA12_HOME (a toolkit
# from scripts/cuda12_toolkit.sh), also with that CUDA 12 compiler, for the architectures
# CMake gives a compiler older than CUDA 12.8. One line per compiler.
#
#   scripts/check_nvcc_versions.sh               # 13.0 ... 13.5
#   VERSIONS="13.4 13.5" CUDA12_HOME=build/cuda-12 scripts/check_nvcc_versions.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${VERSIONS:-"13.0 13.1 13.2 13.3 13.4 13.5"}
ARCHS=${ARCHS:-"80 86 89 90 100 120"}
ARCHS_BEFORE_12_8="80 86 89 90"
WORK=${WORK:-$(mktemp -d)}
status=0

# Compiles the kernels with NVCC for each architecture given; prints one line.
check() {
  local nvcc=$1 version failed=() out list
  shift
  list="$*"
  version=$("$nvcc" --version | sed -n 's/.*release [0-9.]*, V\([0-9.]*\).*/\1/p')
  for a in "$@"; do
    if ! out=$(env PATH=/usr/bin:/bin "$nvcc" -std=c++17 --expt-relaxed-constexpr \
        -gencode "arch=compute_$a,code=sm_$a" -Xptxas=-warn-spills -Werror=all-warnings \
        -c cuda/andrea_clip_kernels.cu -o "$WORK/k.o" 2>&1); then
      failed+=("sm_$a"); echo "$out" | tail -5
    fi
  done
  if ((${#failed[@]})); then
    echo "nvcc $version: FAILED for ${failed[*]}"; status=1
  else
    echo "nvcc $version: ok for sm_${list// /, sm_}"
  fi
}

for v in $VERSIONS; do
  env="$WORK/nvcc-$v"
  python3 -m venv "$env"
  if ! "$env/bin/pip" install -q "nvidia-cuda-nvcc==$v.*" "nvidia-nvvm==$v.*" \
      "nvidia-cuda-crt==$v.*" "nvidia-cuda-runtime==$v.*" "nvidia-cuda-cccl>=13.0,<14"; then
    echo "nvcc $v: not installable"; status=1; continue
  fi
  # shellcheck disable=SC2086  # the architectures are words
  check "$(ls "$env"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)" $ARCHS
done
if [[ -n "${CUDA12_HOME:-}" ]]; then
  # shellcheck disable=SC2086
  check "$CUDA12_HOME/bin/nvcc" $ARCHS_BEFORE_12_8
fi
exit $status
