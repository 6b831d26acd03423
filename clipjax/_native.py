"""The native modules: loading them, registering their handlers with XLA, and saying
why one cannot run (not built, failed to load, no code for this GPU)."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shlex
import urllib.parse
import warnings
from pathlib import Path
from typing import NamedTuple

import jax

_loaded: dict[str, object] = {}  # "cpu"/"cuda" -> the loaded native module
_load_errors: dict[str, str] = {}  # platform -> why its module did not load
_NATIVE_MODULES = {"cpu": "_clipjax_cpu", "cuda": "_clipjax_cuda"}
# The module of CUDA 12 kernels that a release wheel holds beside the CUDA 13 one, loaded
# instead where the driver is too old for the other.
_CUDA12_MODULE = "_cuda12._clipjax_cuda"
# The oldest NVIDIA driver (Linux) that runs code of a CUDA major: a CUDA runtime runs on
# any driver of its major (minor version compatibility), from the first of that major on.
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
# Why a module can be missing from an install.
_UNBUILT_BECAUSE = {"cpu": "imported from a source tree that pip never built",
                    "cuda": "no CUDA compiler at build time, or CLIPJAX_CUDA=0"}


def cuda_text(version: int) -> str:
  """A CUDA version as the runtime and driver APIs give it (13000) in words ("13.0")."""
  return f"{version // 1000}.{version % 1000 // 10}"


def driver_needed(runtime: int) -> str:
  """What a module linked with CUDA runtime `runtime` (e.g. 13000) needs of the driver."""
  driver = MIN_DRIVER.get(runtime // 1000)
  return (f"NVIDIA driver {driver} or later" if driver else "an NVIDIA driver") + (
      f" (one for CUDA {runtime // 1000}.0 or later)")


def driver_cuda_version() -> int | None:
  """The newest CUDA version the installed NVIDIA driver supports (e.g. 12020 for driver
  535), asked of the driver library itself; None where there is no driver."""
  try:
    libcuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  version = ctypes.c_int(0)
  return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def driver_too_old(runtime: int, driver: int | None) -> bool:
  """Whether a driver supporting CUDA `driver` cannot run a module of CUDA `runtime`."""
  return driver is not None and driver // 1000 < runtime // 1000


def runtime_ffi_api() -> tuple[int, int] | None:
  """The XLA FFI API (major, minor) of the running jaxlib, from the headers it ships; None
  where they cannot be read."""
  try:
    text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
  except (OSError, AttributeError):
    return None
  found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text))
  return (int(found["MAJOR"]), int(found["MINOR"])) if len(found) == 2 else None


def ffi_mismatch(built: tuple[int, int], runtime: tuple[int, int] | None) -> str | None:
  """Why XLA would refuse handlers built against FFI API `built` (it refuses a newer API
  than its own, and a failed registration takes JAX's backend down with it), or None."""
  if runtime is None or (built[0] == runtime[0] and built[1] <= runtime[1]):
    return None
  return (f"it was built against XLA FFI API {built[0]}.{built[1]}, newer than this jaxlib's "
          f"{runtime[0]}.{runtime[1]} (jaxlib {jax.lib.__version__})")


def _load(platform: str, name: str) -> None:
  """Imports the platform's module and hands its handlers to JAX, or records why not."""
  try:
    module = importlib.import_module(f"clipjax.{name}")
  except ImportError as e:  # an install without that extension, or one that cannot load
    _load_errors[platform] = str(e)
    return
  mismatch = ffi_mismatch(tuple(module.FFI_API), runtime_ffi_api())
  if mismatch:
    _load_errors[platform] = mismatch
    return
  _loaded[platform] = module
  for target, capsule in module.registrations().items():
    jax.ffi.register_ffi_target(target, capsule,
                                platform=platform.upper() if platform == "cuda" else platform)


def _installed(name: str) -> bool:
  """Whether the module clipjax.`name` is in this install (without importing it)."""
  try:
    return importlib.util.find_spec(f"clipjax.{name}") is not None
  except ModuleNotFoundError:  # its parent package is not
    return False


def cuda_module_name() -> str:
  """The CUDA module to load: the install's first, unless the install also holds one of
  CUDA 12 kernels and the driver is too old for the first's CUDA (or it does not load)."""
  name = _NATIVE_MODULES["cuda"]
  if not _installed(_CUDA12_MODULE):
    return name
  try:
    runtime = importlib.import_module(f"clipjax.{name}").BUILD["runtime"]
  except ImportError:
    return _CUDA12_MODULE
  return _CUDA12_MODULE if driver_too_old(runtime, driver_cuda_version()) else name


for _platform, _name in _NATIVE_MODULES.items():
  _load(_platform, cuda_module_name() if _platform == "cuda" else _name)


def platforms() -> tuple[str, ...]:
  """The platforms on which the clip's custom call can run in this process.

  A platform is listed where this install holds its handler module and the module loaded
  and registered with XLA: "cpu" for the C++ handler, "cuda" for the CUDA kernels.
  `impl="ffi"` needs the platform listed; `impl="auto"` takes the custom call on CUDA
  where "cuda" is listed. `python -m clipjax` says why a platform is missing.

  Returns:
    The lowering platforms' names, sorted, as a tuple of str.

  Examples:
    >>> import clipjax
    >>> "cpu" in clipjax.ffi_platforms()
    True
    >>> set(clipjax.ffi_platforms()) <= {"cpu", "cuda"}
    True
  """
  return tuple(sorted(_loaded))


def module(platform: str):
  """The platform's loaded native module, or None."""
  return _loaded.get(platform.lower())


def built(platform: str) -> bool:
  """Whether this install holds the platform's module (loaded or not)."""
  name = _NATIVE_MODULES.get(platform.lower())
  return name is not None and _installed(name)


def cuda_devices() -> list:
  """This process's CUDA devices ([] where JAX has no CUDA backend)."""
  try:
    return jax.local_devices(backend="cuda")
  except RuntimeError:
    return []


class Problem(NamedTuple):
  why: str  # what stops the custom call, for a message
  fix: str  # the one command that fixes it


def reinstall_command(env: str = "") -> str:
  """The pip command that rebuilds clipjax from where it was installed from."""
  source = '"clipjax[cuda13]"'
  try:
    direct = importlib.metadata.distribution("clipjax").read_text("direct_url.json")
    origin = json.loads(direct) if direct else {}
  except (importlib.metadata.PackageNotFoundError, ValueError):
    origin = {}
  url = origin.get("url", "")
  if url.startswith("file://"):
    path = shlex.quote(urllib.parse.unquote(url[len("file://"):]))
    source = f"-e {path}" if origin.get("dir_info", {}).get("editable") else path
  return f"{env}pip install --force-reinstall --no-deps {source}"


@functools.cache
def _cuda_device_problem() -> Problem | None:
  """Why a visible CUDA GPU cannot run the loaded CUDA module's kernels, or None: asked of
  the CUDA runtime once per process, on the first use, for every local CUDA device."""
  module = _loaded["cuda"]
  for device in cuda_devices():
    error, _, _ = module.kernel_image(device.local_hardware_id)
    if not error:
      continue
    if "InsufficientDriver" in error:
      runtime = module.BUILD["runtime"]
      return Problem(f"its CUDA {cuda_text(runtime)} runtime needs a newer NVIDIA driver: "
                     f"{driver_needed(runtime)} ({error})",
                     "install an NVIDIA driver for that CUDA version, or build with this "
                     "machine's own CUDA toolkit: CUDACXX=/path/to/nvcc " + reinstall_command())
    capability = str(getattr(device, "compute_capability", ""))
    return Problem(f"it has no code that {device.device_kind} (compute capability "
                   f"{capability or '?'}) can run: it was built for "
                   f"{module.BUILD['architectures']} ({error})",
                   reinstall_command(f"CUDAARCHS={capability.replace('.', '') or 'native'} "))
  return None


def handler_problem(platform: str) -> Problem | None:
  """Why the custom call cannot run on `platform` in this process, or None when it can:
  its module was not built, failed to load (with the loader's error), or (CUDA) holds no
  code for a visible GPU's architecture."""
  platform = platform.lower()
  if platform not in _NATIVE_MODULES:
    return Problem(f"clipjax has no custom-call handler for platform '{platform}'",
                   "use impl='jax'")
  if platform not in _loaded:
    if not built(platform):
      return Problem(f"this install of clipjax was built without its {platform.upper()} "
                     f"module ({_UNBUILT_BECAUSE[platform]})", reinstall_command())
    why = _load_errors.get(platform, "it was not imported")
    return Problem(f"its {platform.upper()} module failed to load: {why}", reinstall_command())
  if platform == "cuda":
    return _cuda_device_problem()
  return None


def has_handler(platform: str) -> bool:
  return handler_problem(platform) is None


def missing_handler_message(platform: str) -> str:
  have = ", ".join(p for p in platforms() if has_handler(p)) or "none"
  problem = handler_problem(platform)
  return (f"clipjax: impl='ffi' needs a custom-call handler for platform '{platform}', "
          f"but handlers are registered only for: {have}. Use impl='jax' or impl='auto'. "
          f"({problem.why}; to fix: {problem.fix})")


@functools.cache
def _warn_cuda_fallback(problem: Problem) -> None:
  warnings.warn(f"clipjax: impl='auto' runs the pure-JAX clip on this CUDA GPU, not the CUDA "
                f"custom call: {problem.why}. To fix: {problem.fix}", RuntimeWarning,
                stacklevel=5)


def cuda_usable() -> bool:
  """Whether impl="auto" can run the custom call on CUDA. Where a CUDA GPU is visible and
  it cannot, this warns once per process, saying why and what fixes it."""
  problem = handler_problem("cuda")
  if problem is not None and cuda_devices():
    _warn_cuda_fallback(problem)
  return problem is None


def layout():
  """A loaded native module, for the sizes of a call's results (every module has them)."""
  if not _loaded:
    raise RuntimeError("clipjax: no native extension is importable: " +
                       "; ".join(f"{p}: {e}" for p, e in sorted(_load_errors.items())))
  return next(iter(_loaded.values()))
