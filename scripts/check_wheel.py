"""Checks a release wheel: what `auditwheel show` says of it, its modules, the GPU code in
its CUDA module, the symbols its modules take from the system, and that they load.

  python scripts/check_wheel.py WHEEL [--python PYTHON] [--cuobjdump PATH]

Fails (exit 1) naming every check that did not hold:
- `auditwheel show` finds it consistent with manylinux_2_28 or older, and its name says so;
- it holds the CPU and the CUDA module, and `_variant.py` names a CUDA build;
- the CUDA module holds real code for sm_80 to sm_120 and PTX for sm_80, which the driver
  compiles for any newer GPU (`cuobjdump --list-elf`, `--list-ptx`); the module of CUDA 12
  kernels, where the wheel holds one (clipjax/_cuda12/), sm_80 to sm_90 (the CUDA 12
  compiler that installs here, 12.4, knows no newer) and PTX for sm_80;
- every symbol the modules take from a system library carries a glibc version no newer
  than 2.28 (an unversioned one would bind to whatever the loader finds), Python's aside;
- both modules load in PYTHON (by default this one), without jax: a module's own
  initialisation is what a missing symbol or a too new glibc breaks.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MAX_GLIBC = (2, 28)
SASS = {"_clipjax_cuda": {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"},
        "_cuda12/_clipjax_cuda": {"sm_80", "sm_86", "sm_89", "sm_90"}}
PTX = {"sm_80"}
LOAD = """
import importlib.util, sys
for path in sys.argv[1:]:
  name = "clipjax." + path.split("clipjax/", 1)[1].split(".")[0].replace("/", ".")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  print(name, "loads", getattr(module, "BUILD", ""))
"""


def manylinux_versions(text: str) -> list[tuple[int, int]]:
  return [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)", text)]


def check_tag(wheel: Path) -> list[str]:
  problems = []
  named = manylinux_versions(wheel.name)
  if not named or max(named) > MAX_GLIBC:
    problems.append(f"its name carries no manylinux tag of glibc 2.28 or older: {wheel.name}")
  show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                        capture_output=True, text=True)
  found = re.search(r'consistent with\s+the\s+following\s+platform\s+tag:\s+"([^"]+)"',
                    show.stdout)
  if not found:
    problems.append(f"`auditwheel show` names no platform tag: {show.stdout}{show.stderr}")
  elif max(manylinux_versions(found.group(1)) or [(9, 99)]) > MAX_GLIBC:
    problems.append(f"`auditwheel show`: consistent with {found.group(1)} only")
  else:
    print(f"auditwheel show: consistent with {found.group(1)}")
  return problems


def check_architectures(module: Path, sass: set[str], cuobjdump: str) -> list[str]:
  problems = []
  for flag, want in (("--list-elf", sass), ("--list-ptx", PTX)):
    listing = subprocess.run([cuobjdump, flag, str(module)], capture_output=True, text=True)
    have = set(re.findall(r"\.(sm_\d+)\.", listing.stdout))
    print(f"{module.parent.name}/{module.name}: cuobjdump {flag}: "
          f"{' '.join(sorted(have, key=lambda a: int(a[3:])))}")
    if have != want:
      problems.append(f"cuobjdump {flag}: {sorted(have)}, not {sorted(want)}")
  return problems


def check_symbols(module: Path) -> list[str]:
  """Symbols taken from system libraries: each with a glibc version no newer than 2.28
  (none from libstdc++ or libgcc, which the release links in), one line per kind."""
  table = subprocess.run(["nm", "-D", "--undefined-only", str(module)], capture_output=True,
                         text=True, check=True).stdout
  newer, other, unversioned = set(), set(), set()
  for line in table.splitlines():
    kind, symbol = line.split()[0], line.split()[-1]
    name, _, version = symbol.partition("@")
    version = version.lstrip("@")
    numbers = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", version)
    if name.startswith(("Py", "_Py")) or kind == "w":
      continue
    if numbers:
      if (int(numbers.group(1)), int(numbers.group(2))) > MAX_GLIBC:
        newer.add(symbol)
    elif version:
      other.add(version.split("_")[0])
    else:
      unversioned.add(name)
  problems = []
  if newer:
    problems.append(f"{module.name} needs glibc newer than 2.28: {', '.join(sorted(newer)[:5])}")
  if other:
    problems.append(f"{module.name} takes symbols of {', '.join(sorted(other))} from the system")
  if unversioned:
    problems.append(f"{module.name} takes {len(unversioned)} symbols from the system without a "
                    f"version: {', '.join(sorted(unversioned)[:5])}")
  return problems


def check(wheel: Path, python: str, cuobjdump: str | None) -> list[str]:
  problems = check_tag(wheel)
  with tempfile.TemporaryDirectory() as folder:
    zipfile.ZipFile(wheel).extractall(folder)
    package = Path(folder) / "clipjax"
    modules = {kind: next(package.glob(f"_clipjax_{kind}.*.so"), None) for kind in ("cpu", "cuda")}
    problems += [f"no {kind.upper()} module" for kind, path in modules.items() if path is None]
    cuda12 = next(package.glob("_cuda12/_clipjax_cuda.*.so"), None)
    variant = (package / "_variant.py").read_text() if (package / "_variant.py").exists() else ""
    if 'VARIANT = "cu' not in variant:
      problems.append(f"_variant.py names no CUDA build: {variant!r}")
    present = [path for path in (*modules.values(), cuda12) if path is not None]
    for path in present:
      problems += check_symbols(path)
    for path, sass in ((modules["cuda"], SASS["_clipjax_cuda"]),
                       (cuda12, SASS["_cuda12/_clipjax_cuda"])):
      if path is not None and cuobjdump:
        problems += check_architectures(path, sass, cuobjdump)
    if not cuobjdump:
      problems.append("no cuobjdump to list the CUDA modules' architectures")
    loaded = subprocess.run([python, "-c", LOAD, *map(str, present)], capture_output=True,
                            text=True, cwd=folder)
    print(loaded.stdout.strip())
    if loaded.returncode != 0:
      problems.append(f"the modules do not load in {python}: {loaded.stderr.strip()}")
  return problems


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("wheels", nargs="+", type=Path)
  parser.add_argument("--python", default=sys.executable, help="the Python that loads the modules")
  parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
  args = parser.parse_args()
  failed = False
  for wheel in args.wheels:
    print(f"== {wheel.name}")
    problems = check(wheel, args.python, args.cuobjdump)
    for problem in problems:
      print(f"FAILED: {problem}")
    failed |= bool(problems)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
