"""What an install says of itself.

- Where a CUDA GPU cannot run the custom call (the module was not built, failed to load,
  or holds no code for that GPU), impl="auto" runs the pure-JAX clip and warns once per
  process, saying why and naming the command that fixes it. A CUDA backend is faked here.
- `python -m clipjax` prints what a bug report needs.
- The build picks its CUDA compiler (build_support/clipjax_build.py) and names the wheel.
"""

import subprocess
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import pytest

import clipjax
from clipjax import _native
from conftest import load_script


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

  def __init__(self, error):
    self.error = error

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
  assert "CUDA 13.0 runtime needs a newer NVIDIA driver" in messages[0]
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
    assert "for architectures " in out, out


def test_version_comes_from_one_place():
  import clipjax._version
  assert clipjax.__version__ == clipjax._version.__version__
  build = load_build_support()
  assert build.dynamic_metadata("version").split("+")[0] == clipjax.__version__


# --- the build's choice of compiler -----------------------------------------------------

def load_build_support():
  return load_script("build_support/clipjax_build.py")


@pytest.fixture
def no_system_compiler(monkeypatch, tmp_path):
  for name in ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "CLIPJAX_CUDA"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("PATH", str(tmp_path))
  build = load_build_support()
  monkeypatch.setattr(build, "PIP_TOOLKIT", Path("no-such-toolkit"))  # as in jax[cuda13]
  return build


def test_a_machine_without_nvcc_gets_the_compiler_from_pypi(no_system_compiler, monkeypatch):
  build = no_system_compiler
  monkeypatch.setattr(build.platform, "system", lambda: "Linux")
  monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
  assert build.system_compiler() is None
  assert any(r.startswith("nvidia-cuda-nvcc>=13") for r in build.get_requires_for_dynamic_metadata())


def test_without_any_compiler_the_wheel_is_named_cpu(no_system_compiler, monkeypatch):
  build = no_system_compiler
  monkeypatch.setattr(build.platform, "system", lambda: "Darwin")
  monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
  assert build.get_requires_for_dynamic_metadata() == []
  assert build.cuda_compiler() is None
  assert build.dynamic_metadata("version") == clipjax.__version__ + "+cpu"


def test_the_machines_compiler_wins(no_system_compiler, monkeypatch, tmp_path):
  build = no_system_compiler
  monkeypatch.setenv("CUDACXX", str(tmp_path / "nvcc"))
  assert build.cuda_compiler() == tmp_path / "nvcc"
  assert build.get_requires_for_dynamic_metadata() == []
  assert build.dynamic_metadata("version") == clipjax.__version__


def test_clipjax_cuda_0_builds_the_cpu_handler_only(no_system_compiler, monkeypatch, tmp_path):
  build = no_system_compiler
  monkeypatch.setenv("CUDACXX", str(tmp_path / "nvcc"))
  monkeypatch.setenv("CLIPJAX_CUDA", "0")
  assert build.cuda_compiler() is None
  assert build.get_requires_for_dynamic_metadata() == []
  assert build.dynamic_metadata("version").endswith("+cpu")
