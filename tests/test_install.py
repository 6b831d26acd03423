"""What an install says of itself.

- Where a CUDA GPU cannot run the custom call (the module was not built, failed to load,
  or holds no code for that GPU), impl="auto" runs the pure-JAX clip and warns once per
  process, saying why and naming the command that fixes it. A CUDA backend is faked here.
- `python -m clipjax` prints what a bug report needs, each fact of the CUDA module apart.
- `clipjax.__version__` names the variant (the build itself: tests/test_build.py).
"""

import re
import subprocess
import sys
import tomllib
import warnings
from typing import NamedTuple

import jax.numpy as jnp
import pytest

import clipjax
from clipjax import _native
from conftest import ROOT


class FakeGpu(NamedTuple):
  id: int = 0
  local_hardware_id: int = 0
  device_kind: str = "Tesla T4"
  compute_capability: str = "7.5"
  platform: str = "gpu"


class FakeCudaModule:
  """A loaded CUDA module whose kernels `FakeGpu` cannot run."""
  BUILD = {"architectures": "80-real 86-real 89-real 90-real 100-real 120", "compiler": "13.0.88",
           "runtime": 13000}

  def __init__(self, error, runtime=13000, name="clipjax._clipjax_cuda"):
    self.error = error
    self.BUILD = dict(self.BUILD, runtime=runtime)
    self.__name__ = name

  def kernel_image(self, device):
    del device
    return self.error, 0, 0


@pytest.fixture
def cuda_machine(monkeypatch):
  """A process that sees one CUDA GPU, with the CUDA module's state left to each test."""
  monkeypatch.setattr(_native, "cuda_devices", lambda: [FakeGpu()])
  _native._cuda_device_problem.cache_clear()
  _native._warn_cuda_fallback.cache_clear()
  yield monkeypatch
  _native._cuda_device_problem.cache_clear()
  _native._warn_cuda_fallback.cache_clear()


def auto_clips_and_warnings(times=3):
  """Runs impl="auto" clips of differently shaped trees (each traced anew); returns the
  clipjax warnings they gave."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for n in range(times):
      result = clipjax.clip_tree({"g": jnp.full((3 + n,), 2.0)}, 1.0)
      assert float(result.global_norm) == pytest.approx(2.0 * (3 + n) ** 0.5)
  return [str(w.message) for w in caught if "clipjax" in str(w.message)]


def test_auto_warns_once_when_the_cuda_module_was_not_built(cuda_machine):
  cuda_machine.delitem(_native._loaded, "cuda", raising=False)
  cuda_machine.setattr(_native, "built", lambda platform: platform == "cpu")
  messages = auto_clips_and_warnings()
  assert len(messages) == 1
  assert "pure-JAX clip on this CUDA GPU" in messages[0]
  assert "built without its CUDA module" in messages[0]
  assert "pip install --force-reinstall --no-deps" in messages[0]


@pytest.mark.parametrize("platform, because", [
    ("cpu", "imported from a source tree"), ("cuda", "no CUDA compiler at build time")])
def test_a_missing_module_is_named_with_its_own_reason(monkeypatch, platform, because):
  monkeypatch.delitem(_native._loaded, platform, raising=False)
  monkeypatch.setattr(_native, "built", lambda name: False)
  problem = _native.handler_problem(platform)
  assert f"built without its {platform.upper()} module ({because}" in problem.why
  assert "pip install --force-reinstall --no-deps" in problem.fix


def test_auto_warns_with_the_loaders_error(cuda_machine):
  cuda_machine.delitem(_native._loaded, "cuda", raising=False)
  cuda_machine.setattr(_native, "built", lambda platform: True)
  cuda_machine.setitem(_native._load_errors, "cuda", "libstdc++.so.6: version `GLIBCXX_3.4.32' not found")
  messages = auto_clips_and_warnings()
  assert len(messages) == 1
  assert "failed to load: libstdc++.so.6: version `GLIBCXX_3.4.32' not found" in messages[0]


def test_auto_warns_when_the_module_has_no_code_for_this_gpu(cuda_machine):
  error = "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device"
  cuda_machine.setitem(_native._loaded, "cuda", FakeCudaModule(error))
  messages = auto_clips_and_warnings()
  assert len(messages) == 1
  assert "no code that Tesla T4 (compute capability 7.5) can run" in messages[0]
  assert "built for 80-real 86-real 89-real 90-real 100-real 120" in messages[0]
  assert error in messages[0]
  assert "CUDAARCHS=75 pip install --force-reinstall --no-deps" in messages[0]


def test_auto_warns_when_the_driver_is_older_than_the_runtime(cuda_machine):
  error = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
  cuda_machine.setitem(_native._loaded, "cuda", FakeCudaModule(error))
  messages = auto_clips_and_warnings()
  assert len(messages) == 1
  assert "CUDA 13.0 runtime needs a newer NVIDIA driver: NVIDIA driver 580.65.06 or later" in messages[0]
  assert "CUDACXX=" in messages[0]


def test_impl_ffi_refuses_with_the_same_reason(cuda_machine):
  error = "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device"
  cuda_machine.setitem(_native._loaded, "cuda", FakeCudaModule(error))
  cuda_machine.setattr("clipjax._dispatch.default_platform", lambda: "cuda")
  with pytest.raises(RuntimeError, match=r"platform 'cuda'.*compute capability 7\.5.*CUDAARCHS=75"):
    clipjax.clip_tree({"g": jnp.ones(3)}, 1.0, impl="ffi")


def test_a_module_built_against_a_newer_ffi_api_is_not_registered(monkeypatch):
  """XLA refuses a handler built against a newer FFI API than its own, and the failed
  registration would take JAX's whole backend down: such a module is left unregistered,
  and says why."""
  monkeypatch.setattr(_native, "_loaded", {})
  monkeypatch.setattr(_native, "_load_errors", {})
  monkeypatch.setattr(_native, "runtime_ffi_api", lambda: (0, 0))
  _native._load("cpu", "_clipjax_cpu")
  assert _native.platforms() == ()
  problem = _native.handler_problem("cpu")
  assert "built against XLA FFI API 0." in problem.why and "newer than this jaxlib's 0.0" in problem.why
  assert "pip install --force-reinstall" in problem.fix


def test_ffi_api_rule():
  assert _native.ffi_mismatch((0, 1), (0, 5)) is None
  assert _native.ffi_mismatch((0, 4), (0, 4)) is None
  assert _native.ffi_mismatch((0, 5), (0, 4)) is not None
  assert _native.ffi_mismatch((1, 0), (0, 5)) is not None
  assert _native.ffi_mismatch((0, 5), None) is None  # headers unreadable: XLA decides
  runtime = _native.runtime_ffi_api()
  assert runtime is not None
  for platform in _native.platforms():
    assert _native.ffi_mismatch(tuple(_native.module(platform).FFI_API), runtime) is None


def test_no_warning_without_a_cuda_gpu(monkeypatch):
  monkeypatch.setattr(_native, "cuda_devices", lambda: [])
  monkeypatch.delitem(_native._loaded, "cuda", raising=False)
  _native._warn_cuda_fallback.cache_clear()
  assert auto_clips_and_warnings() == []


def test_python_m_clipjax_reports_versions_handlers_and_paths(tmp_path):
  # From elsewhere than the repository's root, whose clipjax/ would shadow the installed one.
  out = subprocess.run([sys.executable, "-m", "clipjax"], capture_output=True, text=True,
                       check=True, timeout=300, cwd=tmp_path).stdout
  assert out.startswith("clipjax ")
  for line in ("jax ", "jaxlib ", "backends:", "  cpu: ", "custom-call handlers:",
               "  cpu: usable", 'impl="auto" takes:', "  on cpu: pure JAX"):
    assert line in out, out
  if _native.built("cuda"):  # with a CUDA compiler at build time, as in CI
    assert "CUDA runtime 13." in out or "CUDA runtime 12." in out, out
    assert "architectures 8" in out, out


def test_the_report_never_calls_the_cuda_module_usable_without_a_device(monkeypatch):
  """Each fact apart: built, loads, a device visible, a driver new enough."""
  from clipjax import __main__ as report
  monkeypatch.setattr(_native, "cuda_devices", lambda: [])
  monkeypatch.setattr(_native, "driver_cuda_version", lambda: None)
  monkeypatch.setattr(_native, "built", lambda platform: True)
  monkeypatch.setitem(_native._loaded, "cuda", FakeCudaModule(""))
  lines = report._handler_lines("cuda")
  assert lines[0] == "  cuda: NOT usable here: no CUDA device is visible"
  assert lines[1].startswith("    built: yes (nvcc 13.0.88, CUDA runtime 13.0 linked statically")
  assert lines[2:5] == ["    loads: yes (clipjax._clipjax_cuda)", "    CUDA devices visible: none",
                        "    NVIDIA driver: none found; this build needs NVIDIA driver "
                        "580.65.06 or later (one for CUDA 13.0 or later)"]


def test_the_report_names_a_driver_too_old_for_the_build(cuda_machine):
  from clipjax import __main__ as report
  cuda_machine.setattr(_native, "driver_cuda_version", lambda: 12020)  # driver 535
  cuda_machine.setattr(_native, "built", lambda platform: True)
  cuda_machine.setitem(_native._loaded, "cuda", FakeCudaModule(
      "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"))
  lines = report._handler_lines("cuda")
  assert lines[0].startswith("  cuda: NOT usable: its CUDA 13.0 runtime needs a newer NVIDIA driver")
  assert "    CUDA devices visible: 1" in lines
  assert ("    NVIDIA driver: supports CUDA 12.2, too old; this build needs NVIDIA driver "
          "580.65.06 or later (one for CUDA 13.0 or later)") in lines


def test_the_report_of_a_module_that_does_not_load(monkeypatch):
  from clipjax import __main__ as report
  monkeypatch.delitem(_native._loaded, "cuda", raising=False)
  monkeypatch.setattr(_native, "built", lambda platform: True)
  monkeypatch.setitem(_native._load_errors, "cuda", "GLIBC_2.34 not found")
  monkeypatch.setattr(_native, "driver_cuda_version", lambda: None)
  lines = report._handler_lines("cuda")
  assert lines[0] == "  cuda: NOT usable: its CUDA module failed to load: GLIBC_2.34 not found"
  assert lines[1:4] == ["    built: yes", "    loads: no: GLIBC_2.34 not found",
                        "    CUDA devices visible: none"]


@pytest.mark.parametrize("runtime, driver, too_old", [
    (13000, None, False), (13000, 12090, True), (13000, 13000, False), (13020, 13000, False),
    (12080, 12020, False), (12000, 11080, True)])
def test_the_driver_rule_is_the_cuda_major(runtime, driver, too_old):
  assert _native.driver_too_old(runtime, driver) is too_old


@pytest.mark.parametrize("driver, loaded", [
    (None, "_clipjax_cuda"), (13000, "_clipjax_cuda"), (12020, "_cuda12._clipjax_cuda")])
def test_a_driver_too_old_for_cuda_13_gets_the_cuda_12_module(monkeypatch, driver, loaded):
  """A release wheel holds the kernels twice: built with CUDA 13, and with CUDA 12 for
  drivers from 525 on; clipjax loads the one the driver runs."""
  monkeypatch.setattr(_native, "_installed", lambda name: True)
  monkeypatch.setattr(_native, "driver_cuda_version", lambda: driver)
  monkeypatch.setattr(_native.importlib, "import_module", lambda name: FakeCudaModule(""))
  assert _native.cuda_module_name() == loaded


def test_the_report_names_the_driver_each_cuda_module_needs(monkeypatch):
  from clipjax import __main__ as report
  monkeypatch.setattr(_native, "cuda_devices", lambda: [])
  monkeypatch.setattr(_native, "driver_cuda_version", lambda: 12020)
  monkeypatch.setattr(_native, "_installed", lambda name: True)
  monkeypatch.setitem(_native._loaded, "cuda",
                      FakeCudaModule("", runtime=12040, name="clipjax._cuda12._clipjax_cuda"))
  monkeypatch.setattr(report.importlib, "import_module", lambda name: FakeCudaModule(""))
  lines = report._handler_lines("cuda")
  assert "    loads: yes (clipjax._cuda12._clipjax_cuda)" in lines
  assert ("    NVIDIA driver: supports CUDA 12.2, new enough; this build needs NVIDIA driver "
          "525.60.13 or later (one for CUDA 12.0 or later)") in lines
  assert lines[-1] == ("    also holds clipjax._clipjax_cuda: CUDA 13.0 kernels, for NVIDIA "
                       "driver 580.65.06 or later (one for CUDA 13.0 or later)")


def test_without_a_cuda_12_module_the_first_is_loaded_whatever_the_driver(monkeypatch):
  monkeypatch.setattr(_native, "_installed", lambda name: name == "_clipjax_cuda")
  monkeypatch.setattr(_native, "driver_cuda_version", lambda: 12020)
  assert _native.cuda_module_name() == "_clipjax_cuda"


def test_this_machine_has_no_driver_and_the_report_says_so(tmp_path):
  """On a machine without a GPU or driver (CI), the CUDA module is never called usable."""
  if _native.driver_cuda_version() is not None:
    pytest.skip("this machine has an NVIDIA driver")
  out = subprocess.run([sys.executable, "-m", "clipjax"], capture_output=True, text=True,
                       check=True, timeout=300, cwd=tmp_path).stdout
  assert "cuda: usable" not in out, out
  if _native.built("cuda"):
    assert "CUDA devices visible: none" in out and "NVIDIA driver: none found" in out, out


def test_version_comes_from_one_place():
  import clipjax._version
  assert clipjax.__version__.split("+")[0] == clipjax._version.VERSION
  settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
  regex = settings["metadata"]["version"]["regex"]
  source = (ROOT / settings["metadata"]["version"]["input"]).read_text()
  assert re.search(regex, source, re.M).group("value") == clipjax._version.VERSION


def test_version_names_the_variant_of_a_built_install():
  try:
    from clipjax._variant import VARIANT
  except ImportError:
    pytest.skip("clipjax is imported from a source tree that pip never built")
  assert clipjax.__version__ == f"{clipjax._version.VERSION}+{VARIANT}"
  assert (VARIANT != "cpu") == _native.built("cuda")

