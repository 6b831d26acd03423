"""`python -m clipjax`: what a bug report needs to know of this install and this machine.

Versions, JAX's backends and devices, each custom-call handler (for CUDA, each apart:
whether it was built and with what, whether it loads, whether a device is visible, whether
the driver is new enough, which code each GPU runs), and the path `impl="auto"` takes on
each backend.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

import jax

import clipjax
from clipjax import _native

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt",
            "jax-cuda12-pjrt", "optax", "numpy")
BACKENDS = ("cpu", "cuda", "rocm", "tpu")


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _devices(backend: str) -> list:
  try:
    return jax.devices(backend)
  except RuntimeError:
    return []


def _cuda_facts(module) -> list[str]:
  """What was seen of the CUDA module, each fact apart: built, loads, a device visible, a
  driver new enough; then the code each device runs."""
  built = _native.built("cuda")
  lines = [f"    built: {'yes' if built else 'no'}"]
  if not built:
    return lines
  load_error = _native._load_errors.get("cuda")
  lines.append(f"    loads: {'no: ' + load_error if module is None and load_error else 'yes'}"
               + (f" ({module.__name__})" if module is not None else ""))
  devices = _native.cuda_devices()
  lines.append(f"    CUDA devices visible: {len(devices) or 'none'}")
  driver = _native.driver_cuda_version()
  if module is None:
    lines.append(f"    NVIDIA driver: {'CUDA ' + _native.cuda_text(driver) if driver else 'none found'}")
    return lines
  build = module.BUILD
  runtime = build["runtime"]
  lines[0] += (f" (nvcc {build['compiler']}, CUDA runtime {_native.cuda_text(runtime)} linked "
               f"statically, architectures {build['architectures']})")
  verdict = ("none found" if driver is None else f"supports CUDA {_native.cuda_text(driver)}, "
             + ("too old" if _native.driver_too_old(runtime, driver) else "new enough"))
  lines.append(f"    NVIDIA driver: {verdict}; this build needs {_native.driver_needed(runtime)}")
  for device in devices:
    error, binary, ptx = module.kernel_image(device.local_hardware_id)
    runs = error or (f"runs sm_{binary} code" if binary else "") + (
        f" (JIT-compiled from compute_{ptx} PTX)" if binary != ptx and ptx else "")
    lines.append(f"    device {device.id} ({device.device_kind}): {runs}")
  return lines


def _other_cuda_modules(loaded) -> list[str]:
  """The install's CUDA modules that were not loaded (a release wheel holds CUDA 13 and
  CUDA 12 kernels), and the driver each needs."""
  lines = []
  for name in (_native._NATIVE_MODULES["cuda"], _native._CUDA12_MODULE):
    full = f"clipjax.{name}"
    if (loaded is not None and loaded.__name__ == full) or not _native._installed(name):
      continue
    try:
      runtime = importlib.import_module(full).BUILD["runtime"]
    except ImportError as e:
      lines.append(f"    also holds {full}, which does not load: {e}")
      continue
    lines.append(f"    also holds {full}: CUDA {_native.cuda_text(runtime)} kernels, for "
                 f"{_native.driver_needed(runtime)}")
  return lines


def _handler_lines(name: str) -> list[str]:
  problem = _native.handler_problem(name)
  if problem is not None:
    status = "NOT usable: " + problem.why
  elif name == "cuda" and not _native.cuda_devices():
    status = "NOT usable here: no CUDA device is visible"
  else:
    status = "usable"
  lines = [f"  {name}: {status}"]
  if name == "cuda":
    lines += _cuda_facts(_native.module(name))
    if _native.built("cuda"):
      lines += _other_cuda_modules(_native.module(name))
  if problem is not None:
    lines.append(f"    to fix: {problem.fix}")
  return lines


def _auto_path(backend: str) -> str:
  if backend != "cuda":
    return "pure JAX"
  problem = _native.handler_problem("cuda")
  return "the CUDA custom call" if problem is None else f"pure JAX ({problem.why})"


def report() -> str:
  lines = [f"clipjax {clipjax.__version__} ({clipjax.__file__})",
           f"python {platform.python_version()} on {platform.system()} {platform.machine()}"]
  lines += [f"{p} {v}" for p in PACKAGES if (v := _version(p))]
  lines.append("backends:")
  backends = [b for b in BACKENDS if _devices(b)]
  for backend in backends:
    kinds = sorted({d.device_kind for d in _devices(backend)})
    lines.append(f"  {backend}: {len(_devices(backend))} device(s): {', '.join(kinds)}")
  lines.append("custom-call handlers:")
  for name in ("cpu", "cuda"):
    lines += _handler_lines(name)
  lines.append('impl="auto" takes:')
  lines += [f"  on {backend}: {_auto_path(backend)}" for backend in backends]
  return "\n".join(lines)


if __name__ == "__main__":
  print(report())
  sys.exit(0)
