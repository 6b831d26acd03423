"""Shared helpers: float64 references and random gradient trees."""

import importlib.util
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from watched import run_pytest_on_cpu_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Set in a subprocess that runs a test file on N forced CPU devices: N.
_DEVICES_ENV = "CLIPJAX_TEST_SHARDED_DEVICES"


def load_script(relative_path: str):
  """A script of the repository (not a package) imported as a module, e.g. the build's
  `build_support/clipjax_build.py`."""
  path = ROOT / relative_path
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def f64_norm(tree) -> float:
  """Reference global norm in float64 (NumPy), chunked to bound memory; a complex leaf
  counts as its real and imaginary parts."""
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    x = np.asarray(leaf)
    x = np.stack([x.real, x.imag]) if np.iscomplexobj(x) else x
    flat = x.astype(np.float32).reshape(-1)  # NumPy: no compile per shape
    for start in range(0, flat.size, 1 << 24):
      part = flat[start:start + (1 << 24)].astype(np.float64)
      total += float(np.dot(part, part))
  return float(np.sqrt(total))


def random_tree(key, shapes, dtype=jnp.float32, scale=1.0):
  keys = jax.random.split(key, len(shapes))
  return {f"p{i}": (scale * jax.random.normal(k, s, jnp.float32)).astype(dtype)
          for i, (k, s) in enumerate(zip(keys, shapes))}


def direct_clip_call(operands, *, read_as=None, columns=None, scale=False):
  """The clip custom call made by hand (global mode, max_norm 1, NaN propagated), as the
  handlers decode it: `read_as` one code per operand, `columns` a (first, width) pair per
  operand (zeros: as stored, whole), `scale` the leaves as results. Returns its results."""
  n = len(operands)
  out = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands] if scale else []
  out += [jax.ShapeDtypeStruct((n + 1,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32),
          jax.ShapeDtypeStruct((n, 4), jnp.float32), jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)]
  call = jax.ffi.ffi_call("clipjax_andrea_clip", out)
  return call(jnp.float32(1.0), *operands, mode=np.int64(0), on_nonfinite=np.int64(0),
              read_as=np.asarray([0] * n if read_as is None else read_as, np.int64),
              columns=np.asarray([0] * 2 * n if columns is None else columns, np.int64))


def has_cuda() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


@pytest.fixture(params=["jax", "ffi"])
def impl(request):
  """Both implementations that run on this machine's default platform."""
  return request.param


@pytest.fixture
def sum_by_rows_here(monkeypatch):
  """Makes the pure-JAX path take, on the CPU, the form it takes on CUDA GPUs: the CPU
  joins `pure_jax.ROW_SUM_PLATFORMS`, so its sums are finished by rows, and its clip is
  partitioned per shard like the custom call's. JAX's caches are cleared on the way in and
  out: a jitted function traced in one form would otherwise run in it in the other."""
  from clipjax._backend import pure_jax
  jax.clear_caches()
  monkeypatch.setattr(pure_jax, "ROW_SUM_PLATFORMS", (*pure_jax.ROW_SUM_PLATFORMS, "cpu"))
  yield
  jax.clear_caches()


# What the multi-device tests run: both implementations, and the pure-JAX one in the form
# CUDA GPUs run ("jax_by_rows", `sum_by_rows_here`).
SHARDED_IMPLS = ["jax", "jax_by_rows", "ffi"]


def impl_named(name, request) -> str:
  """The impl for `name`, one of SHARDED_IMPLS or "auto" (`request`: the test's)."""
  if name == "jax_by_rows":
    request.getfixturevalue("sum_by_rows_here")
    return "jax"
  return name


def _multi_device_here() -> bool:
  n = jax.device_count()
  return n >= 2 and n % 2 == 0


def run_file_on_cpu_devices(test_file, count):
  """Runs `test_file` in a subprocess on `count` CPU devices (XLA fixes the CPU device
  count when its backend starts, so it cannot change within this process).

  Inside that subprocess, and where this process already has an even number >= 2 of
  devices (several GPUs), there is nothing to do: the tests run directly.
  """
  child = os.environ.get(_DEVICES_ENV)
  if child:
    if jax.device_count() != int(child):
      pytest.fail(f"--xla_force_host_platform_device_count={child} "
                  f"gave {jax.device_count()} devices")
    pytest.skip(f"this is the {child}-device run")
  if _multi_device_here():
    pytest.skip(f"{jax.device_count()} devices already: the tests of this file run here")
  run_pytest_on_cpu_devices(test_file, count, {_DEVICES_ENV: str(count)})


def multi_device_file(test_file):
  """What a file of multi-device tests declares first: `test_on_cpu_devices, impl =
  multi_device_file(__file__)`.

  - test_on_cpu_devices, in the slow set: the file again in a subprocess of its own on 4
    CPU devices (a 2 x 2 mesh: both axes split), on 8, and on 2 (a size-1 first axis), by
    `run_file_on_cpu_devices`;
  - impl: a fixture that gives each of SHARDED_IMPLS in turn.
  """
  @pytest.mark.slow
  @pytest.mark.parametrize("count", [4, 8, 2])
  def test_on_cpu_devices(count):
    run_file_on_cpu_devices(test_file, count)

  @pytest.fixture(params=SHARDED_IMPLS)
  def impl(request):
    return impl_named(request.param, request)

  return test_on_cpu_devices, impl


@pytest.fixture
def devices():
  """The device count n, where it is even and at least 2."""
  if not _multi_device_here():
    pytest.skip(f"needs an even number >= 2 of devices, not {jax.device_count()}: runs in "
                "the subprocesses of test_on_cpu_devices, or set "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N")
  return jax.device_count()


def compiled_collectives(hlo: str) -> list:
  """(op, element count of its largest result) of every collective in compiled HLO text."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                  r"collective-permute|collective-broadcast)(-start)?\(", line)
    if m:
      sizes = [math.prod(int(d) for d in dims.split(",") if d)
               for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]
      found.append((m.group(2), max(sizes, default=1)))
  return found
