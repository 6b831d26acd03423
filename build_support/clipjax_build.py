"""How clipjax is built: which CUDA compiler, what the build must fetch to get one, and
what the wheel says it holds.

One decision, used by every step of a build:
- the build backend (build_support/clipjax_backend.py) asks `compiler_requirements` which
  packages to install before it builds: NVIDIA's compiler from PyPI when the machine has
  none (or, where pip cannot reach an index for it, stops with one line saying what to do);
- the wheel's build tag (`build_tag`) names the variant, so that pip prefers a CUDA build
  to a CPU-only one of the same version, and the newer CUDA to the older;
- CMakeLists.txt runs this file (`python clipjax_build.py cuda-compiler`, `... variant`)
  for the compiler it builds the CUDA custom call with, and for the variant it records in
  the package (`clipjax.__version__` names it); scripts/build_wheels.sh asks it which
  packages to install for a compiler (`... requirements`).

A compiler is looked for in this order: $CUDACXX, `nvcc` on the PATH, $CUDA_HOME,
$CUDA_PATH, then NVIDIA's `nvidia-cuda-nvcc` package installed beside the build (a toolkit
that none of these names, such as an /usr/local/cuda off the PATH, is not used). A system
nvcc older than MIN_CUDA is passed over. Setting CLIPJAX_CUDA=0 builds the CPU handler only.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

OFF_VALUES = ("0", "off", "false", "no")
# The oldest CUDA the kernels build with (C++17 device code, 32 KB kernel parameters).
MIN_CUDA = (12, 0)
# NVIDIA's compiler from PyPI: CUDA 13 (its `nvidia-cuda-nvcc-cu12` package holds ptxas and
# libnvvm, no nvcc). nvcc's own dependencies (nvvm, the runtime with its static library,
# crt) come with it; pip takes their newest 13.x, as it does nvcc's, so that their
# versions agree. cccl holds the headers that cuda_fp16.h and cuda_bf16.h include.
PIP_COMPILER = ["nvidia-cuda-nvcc>=13.0,<14", "nvidia-cuda-cccl>=13.0,<14"]
PIP_COMPILER_CUDA = 13
# Where NVIDIA's wheels put the toolkit, relative to a site-packages folder.
PIP_TOOLKIT = Path("nvidia") / "cu13"
# The platforms NVIDIA publishes those wheels for.
PIP_PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64")}
# What to do where no compiler can be had, in the one line an install that stops prints.
HOW_TO_GET_ONE = ("set CUDACXX=/path/to/nvcc (CUDA {0}.{1} or later), let pip reach PyPI "
                  "for NVIDIA's compiler, or set CLIPJAX_CUDA=0 to build without the CUDA "
                  "custom call").format(*MIN_CUDA)


class NoCompiler(Exception):
  """No CUDA compiler can be had for a build that wants one."""


def cuda_wanted() -> bool:
  return os.environ.get("CLIPJAX_CUDA", "").strip().lower() not in OFF_VALUES


def nvcc_version(nvcc: Path) -> tuple[int, int] | None:
  """The CUDA release `nvcc --version` reports, or None where it does not run."""
  try:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                         timeout=60).stdout
  except OSError:
    return None
  match = re.search(r"release (\d+)\.(\d+)", out)
  return (int(match.group(1)), int(match.group(2))) if match else None


def _system_candidates() -> list[Path]:
  found = [shutil.which("nvcc")]
  found += [str(Path(root) / "bin" / "nvcc") for root in
            (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if root]
  return [Path(nvcc) for nvcc in found if nvcc and Path(nvcc).is_file()]


def system_compiler() -> Path | None:
  """An nvcc installed on this machine (not from PyPI), recent enough, or None. $CUDACXX
  is taken as given; an nvcc older than MIN_CUDA elsewhere is passed over, with a note."""
  if os.environ.get("CUDACXX"):
    return Path(os.environ["CUDACXX"])
  for nvcc in _system_candidates():
    version = nvcc_version(nvcc)
    if version is not None and version >= MIN_CUDA:
      return nvcc
    print(f"clipjax: not building with {nvcc} (CUDA {version or 'unknown'}: the kernels "
          f"need {MIN_CUDA[0]}.{MIN_CUDA[1]} or later)", file=sys.stderr)
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


def _truthy(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() not in ("", *OFF_VALUES)


def pip_can_fetch_compiler() -> bool:
  """Whether the pip that runs this build may find NVIDIA's compiler: not where it is told
  to use no index (PIP_NO_INDEX), unless a PIP_FIND_LINKS folder holds the nvcc wheel."""
  if not _truthy("PIP_NO_INDEX"):
    return True
  folders = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
  return any(folder.is_dir() and any(folder.glob(f"nvidia_cuda_nvcc-{PIP_COMPILER_CUDA}.*.whl"))
             for folder in folders)


def cuda_compiler() -> Path | None:
  """The compiler the CUDA custom call is built with, or None for a CPU-only build."""
  if not cuda_wanted():
    return None
  return system_compiler() or pip_compiler()


def compiler_requirements() -> list[str]:
  """Packages to install before the build: NVIDIA's compiler where the machine has none.
  Raises NoCompiler where one is wanted, pip could fetch it for this platform, and pip
  cannot reach an index that has it."""
  if not cuda_wanted() or system_compiler() is not None or not pip_compiler_available():
    return []
  if not pip_can_fetch_compiler():
    raise NoCompiler(f"clipjax: no CUDA compiler for the CUDA custom call: no nvcc on this "
                     f"machine, and pip may not fetch NVIDIA's from PyPI (PIP_NO_INDEX is "
                     f"set); to fix: {HOW_TO_GET_ONE}")
  return list(PIP_COMPILER)


def variant() -> str:
  """What the build holds: "cu13" (the CUDA custom call, built with CUDA 13), "cu12", or
  "cpu" (the CPU handler only)."""
  nvcc = cuda_compiler()
  if nvcc is None:
    return "cpu"
  version = nvcc_version(nvcc)
  if version is None:
    raise NoCompiler(f"clipjax: the CUDA compiler {nvcc} does not run (`nvcc --version`); "
                     f"to fix: {HOW_TO_GET_ONE}")
  return f"cu{version[0]}"


def build_tag(name: str) -> str:
  """The wheel's build tag for a variant: its CUDA major first ("13cuda", "12cuda"; "0cpu"
  for a CPU-only build), since pip prefers the higher build tag among wheels of one version
  and platform, and a build tag, unlike a local version (`+cpu`), keeps the version every
  build of a source distribution reports the same."""
  return "0cpu" if name == "cpu" else f"{name.removeprefix('cu')}cuda"


def _compiler_path() -> str:
  nvcc = cuda_compiler()
  return nvcc.as_posix() if nvcc else ""


def main(argv: list[str]) -> int:
  commands = {"cuda-compiler": _compiler_path, "variant": variant,
              "requirements": lambda: " ".join(compiler_requirements())}
  if len(argv) != 1 or argv[0] not in commands:
    print(f"usage: python clipjax_build.py {{{','.join(commands)}}}", file=sys.stderr)
    return 2
  try:
    print(commands[argv[0]]())
  except NoCompiler as e:
    print(e, file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
