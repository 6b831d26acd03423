"""How clipjax is built: which CUDA compiler, and what the build must fetch to get one.

One decision, used by every step of a build:
- the build backend (scikit-build-core) asks `get_requires_for_dynamic_metadata` which
  packages to install before it builds: NVIDIA's compiler from PyPI when the machine has
  none;
- the version (`dynamic_metadata`) carries `+cpu` when the wheel will hold no CUDA module,
  so that the two kinds of wheel have different names;
- CMakeLists.txt runs this file (`python clipjax_build.py cuda-compiler`) for the compiler
  it builds the CUDA custom call with.

A compiler is looked for in this order: $CUDACXX, `nvcc` on the PATH, $CUDA_HOME,
$CUDA_PATH, then NVIDIA's `nvidia-cuda-nvcc` package installed beside the build (a toolkit
that none of these names, such as an /usr/local/cuda off the PATH, is not used). Setting
CLIPJAX_CUDA=0 builds the CPU handler only.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = ROOT / "clipjax" / "_version.py"
OFF_VALUES = ("0", "off", "false", "no")
# NVIDIA's compiler from PyPI: CUDA 13 (its `nvidia-cuda-nvcc-cu12` package has no nvcc).
# nvcc's own dependencies (nvvm, the runtime with its static library, crt) come with it;
# pip takes their newest 13.x, as it does nvcc's, so that their versions agree. cccl
# holds the headers that cuda_fp16.h and cuda_bf16.h include.
PIP_COMPILER = ["nvidia-cuda-nvcc>=13.0,<14", "nvidia-cuda-cccl>=13.0,<14"]
# Where NVIDIA's wheels put the toolkit, relative to a site-packages folder.
PIP_TOOLKIT = Path("nvidia") / "cu13"
# The platforms NVIDIA publishes those wheels for.
PIP_PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64")}


def cuda_wanted() -> bool:
  return os.environ.get("CLIPJAX_CUDA", "").strip().lower() not in OFF_VALUES


def system_compiler() -> Path | None:
  """An nvcc installed on this machine (not from PyPI), or None."""
  if os.environ.get("CUDACXX"):
    return Path(os.environ["CUDACXX"])
  on_path = shutil.which("nvcc")
  if on_path:
    return Path(on_path)
  for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
    if root and (Path(root) / "bin" / "nvcc").is_file():
      return Path(root) / "bin" / "nvcc"
  return None


def pip_compiler() -> Path | None:
  """NVIDIA's nvcc from PyPI, where it is importable by this interpreter, or None."""
  for entry in sys.path:
    nvcc = Path(entry or ".") / PIP_TOOLKIT / "bin" / "nvcc"
    if nvcc.is_file():
      return nvcc
  return None


def pip_compiler_available() -> bool:
  return (platform.system(), platform.machine()) in PIP_PLATFORMS


def cuda_compiler() -> Path | None:
  """The compiler the CUDA custom call is built with, or None for a CPU-only build."""
  if not cuda_wanted():
    return None
  return system_compiler() or pip_compiler()


# --- the scikit-build-core dynamic-metadata plugin -------------------------------------

def get_requires_for_dynamic_metadata(settings=None) -> list[str]:
  """Build requirements beyond pyproject.toml's: the compiler, where none is installed."""
  del settings
  if cuda_wanted() and system_compiler() is None and pip_compiler_available():
    return list(PIP_COMPILER)
  return []


def dynamic_metadata(field: str, settings=None, project=None) -> str:
  """The version: clipjax/_version.py's, with `+cpu` for a build without CUDA."""
  del settings, project
  if field != "version":
    raise ValueError(f"clipjax_build provides only the version, not {field!r}")
  text = VERSION_FILE.read_text(encoding="utf-8")
  match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
  if not match:
    raise ValueError(f"no __version__ = \"...\" line in {VERSION_FILE}")
  return match.group(1) if cuda_compiler() else match.group(1) + "+cpu"


def main(argv: list[str]) -> int:
  if argv != ["cuda-compiler"]:
    print("usage: python clipjax_build.py cuda-compiler", file=sys.stderr)
    return 2
  nvcc = cuda_compiler()
  print(nvcc.as_posix() if nvcc else "")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
