#!/usr/bin/env bash
# Compiles the CUDA kernels with each CUDA 13 compiler that PyPI offers (nvidia-cuda-nvcc
# and the nvvm, crt, runtime and cccl packages of the same release), for every default
# architecture, with ptxas spill warnings as errors: the kernels must build, and never
# spill, with any compiler a user's `pip install` may fetch.
#
#   scripts/check_nvcc_versions.sh               # 13.0 ... 13.5
#   VERSIONS="13.4 13.5" scripts/check_nvcc_versions.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${VERSIONS:-"13.0 13.1 13.2 13.3 13.4 13.5"}
ARCHS=${ARCHS:-"80 86 89 90 100 120"}
WORK=${WORK:-$(mktemp -d)}
status=0
for v in $VERSIONS; do
  env="$WORK/nvcc-$v"
  python3 -m venv "$env"
  if ! "$env/bin/pip" install -q "nvidia-cuda-nvcc==$v.*" "nvidia-nvvm==$v.*" \
      "nvidia-cuda-crt==$v.*" "nvidia-cuda-runtime==$v.*" "nvidia-cuda-cccl>=13.0,<14"; then
    echo "nvcc $v: not installable"; status=1; continue
  fi
  nvcc=$(ls "$env"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
  for a in $ARCHS; do
    if out=$(env PATH=/usr/bin:/bin "$nvcc" -std=c++17 --expt-relaxed-constexpr \
        -gencode "arch=compute_$a,code=sm_$a" -Xptxas=-warn-spills -Werror=all-warnings \
        -c cuda/andrea_clip_kernels.cu -o "$WORK/k.o" 2>&1); then
      echo "nvcc $("$nvcc" --version | grep -o 'V[0-9.]*') sm_$a: ok"
    else
      echo "nvcc $v sm_$a: FAILED"; echo "$out" | tail -5; status=1
    fi
  done
done
exit $status
