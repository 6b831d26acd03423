"""`python -m clipjax`: what a bug report needs to know of this install and this machine.

Versions, JAX's backends and devices, each custom-call handler (what it was built with,
whether it loads, which code each GPU runs), and the path `impl="auto"` takes on each
backend.
"""

from __future__ import annotations

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


def _handler_lines(name: str) -> list[str]:
  problem = _native.handler_problem(name)
  module = _native.module(name)
  lines = [f"  {name}: {'usable' if problem is None else 'NOT usable: ' + problem.why}"]
  if module is not None and hasattr(module, "BUILD"):
    build = module.BUILD
    runtime = build["runtime"]
    lines.append(f"    built with nvcc {build['compiler']}, CUDA runtime "
                 f"{runtime // 1000}.{runtime % 1000 // 10} (linked statically), for "
                 f"architectures {build['architectures']}")
    for device in _native.cuda_devices():
      error, binary, ptx = module.kernel_image(device.local_hardware_id)
      runs = error or (f"runs sm_{binary} code" if binary else "") + (
          f" (JIT-compiled from compute_{ptx} PTX)" if binary != ptx and ptx else "")
      lines.append(f"    device {device.id} ({device.device_kind}): {runs}")
  if problem is not None:
    lines.append(f"    to fix: {problem.fix}")
  return lines


def _auto_path(backend: str) -> str:
  if backend != "cuda":
    return "pure JAX"
  problem = _native.handler_problem("cuda")
  return "the CUDA custom call" if problem is None else f"pure JAX ({problem.why})"


def report() -> str:
  lines = [f"clipjax {_version('clipjax') or clipjax.__version__} ({clipjax.__file__})",
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
