"""The CUDA kernels compile for every architecture of the build without spilling
registers (ptxas warnings are errors here, not in a user's build, where a newer compiler's
performance warning must never fail an install).

Runs wherever the build found a CUDA compiler (CI has one); no GPU is needed.
"""

import subprocess

import pytest

from clipjax import _native
from conftest import ROOT, load_script


def built_architectures():
  module = _native.module("cuda")
  return module.BUILD["architectures"].split() if module is not None else []


def gencode(arch: str) -> str:
  """CMake's notation ("90-real", "120", "90-virtual") as an nvcc -gencode argument."""
  number, _, kind = arch.partition("-")
  code = {"real": f"sm_{number}", "virtual": f"compute_{number}"}.get(
      kind, f"[sm_{number},compute_{number}]")
  return f"arch=compute_{number},code={code}"


NVCC = load_script("build_support/clipjax_build.py").cuda_compiler()


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None or not built_architectures(),
                    reason="clipjax was built without a CUDA compiler")
@pytest.mark.parametrize("arch", built_architectures())
def test_kernels_compile_without_spills(arch, tmp_path):
  result = subprocess.run(
      [str(NVCC), "-std=c++17", "--expt-relaxed-constexpr", "-gencode", gencode(arch),
       "-Xptxas=-warn-spills", "-Werror=all-warnings", "-c",
       str(ROOT / "cuda" / "andrea_clip_kernels.cu"), "-o", str(tmp_path / "kernels.o")],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  assert "spill" not in result.stderr, result.stderr


def test_gencode_reads_cmakes_notation():
  assert gencode("90-real") == "arch=compute_90,code=sm_90"
  assert gencode("120") == "arch=compute_120,code=[sm_120,compute_120]"
  assert gencode("90-virtual") == "arch=compute_90,code=compute_90"
