"""The build's decisions (build_support/clipjax_build.py, clipjax_backend.py).

- The CUDA compiler: the machine's when it is recent enough, else NVIDIA's from PyPI,
  else none; where one is wanted and pip cannot fetch it, one line says what to do.
- The variant, in the wheel's build tag: pip installs a CUDA build over a CPU-only one of
  the same version, and the newer CUDA over the older.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import clipjax
from conftest import ROOT, load_script


def load_build_support():
  return load_script("build_support/clipjax_build.py")


def fake_nvcc(folder: Path, release: str) -> Path:
  """An `nvcc` that reports CUDA `release` (e.g. "12.4") and does nothing else."""
  folder.mkdir(parents=True, exist_ok=True)
  nvcc = folder / "nvcc"
  nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
  nvcc.chmod(0o755)
  return nvcc


@pytest.fixture
def no_system_compiler(monkeypatch, tmp_path):
  for name in ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "CLIPJAX_CUDA", "PIP_NO_INDEX",
               "PIP_FIND_LINKS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("PATH", str(tmp_path / "bin"))
  build = load_build_support()
  monkeypatch.setattr(build, "PIP_TOOLKIT", Path("no-such-toolkit"))  # as in jax[cuda13]
  return build


@pytest.fixture
def linux_x86(no_system_compiler, monkeypatch):
  build = no_system_compiler
  monkeypatch.setattr(build.platform, "system", lambda: "Linux")
  monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
  return build


def test_a_machine_without_nvcc_gets_the_compiler_from_pypi(linux_x86):
  build = linux_x86
  assert build.system_compiler() is None
  assert any(r.startswith("nvidia-cuda-nvcc>=13") for r in build.compiler_requirements())


def test_without_any_compiler_the_build_is_the_cpu_variant(no_system_compiler, monkeypatch):
  build = no_system_compiler
  monkeypatch.setattr(build.platform, "system", lambda: "Darwin")
  monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
  assert build.compiler_requirements() == []
  assert build.cuda_compiler() is None
  assert build.variant() == "cpu"
  assert build.build_tag("cpu") == "0cpu"


def test_the_machines_compiler_wins(no_system_compiler, monkeypatch, tmp_path):
  build = no_system_compiler
  nvcc = fake_nvcc(tmp_path / "cuda-12.4", "12.4")
  monkeypatch.setenv("CUDACXX", str(nvcc))
  assert build.cuda_compiler() == nvcc
  assert build.compiler_requirements() == []
  assert build.variant() == "cu12"
  assert build.build_tag("cu12") == "12cuda"


def test_a_recent_nvcc_on_the_path_is_used_without_fetching_one(linux_x86, tmp_path):
  nvcc = fake_nvcc(tmp_path / "bin", "13.0")
  assert linux_x86.cuda_compiler() == nvcc
  assert linux_x86.compiler_requirements() == []
  assert linux_x86.variant() == "cu13"


def test_an_nvcc_too_old_is_passed_over_for_pypis(linux_x86, tmp_path, capsys):
  fake_nvcc(tmp_path / "bin", "11.8")  # Debian 12's
  assert linux_x86.system_compiler() is None
  assert "CUDA (11, 8): the kernels need 12.0 or later" in capsys.readouterr().err
  assert any(r.startswith("nvidia-cuda-nvcc>=13") for r in linux_x86.compiler_requirements())


def test_clipjax_cuda_0_builds_the_cpu_handler_only(no_system_compiler, monkeypatch, tmp_path):
  build = no_system_compiler
  monkeypatch.setenv("CUDACXX", str(fake_nvcc(tmp_path / "cuda", "13.0")))
  monkeypatch.setenv("CLIPJAX_CUDA", "0")
  assert build.cuda_compiler() is None
  assert build.compiler_requirements() == []
  assert build.variant() == "cpu"


def test_offline_without_a_compiler_the_build_stops_with_one_line(linux_x86, monkeypatch, tmp_path):
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
  with pytest.raises(linux_x86.NoCompiler) as stop:
    linux_x86.compiler_requirements()
  line = str(stop.value)
  assert "\n" not in line
  assert line.startswith("clipjax: no CUDA compiler for the CUDA custom call")
  assert "PIP_NO_INDEX" in line and "CUDACXX=" in line and "CLIPJAX_CUDA=0" in line
  # A find-links folder that holds NVIDIA's compiler is enough.
  (tmp_path / "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.whl").touch()
  assert any(r.startswith("nvidia-cuda-nvcc>=13") for r in linux_x86.compiler_requirements())


def run_backend_hook(hook: str, env: dict) -> subprocess.CompletedProcess:
  """Calls one hook of the build backend in a fresh process, as pip does."""
  code = (f"import sys; sys.path[:0] = ['build_support']; import clipjax_backend; "
          f"print(clipjax_backend.{hook}())")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="NVIDIA's compiler is fetched on Linux alone")
def test_an_offline_install_says_what_to_do_in_one_line(tmp_path):
  """What pip prints of a build that stops: the hook's output, here one line."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "CLIPJAX_CUDA", "PIP_FIND_LINKS")}
  env.update(PATH=os.path.dirname(sys.executable), PIP_NO_INDEX="1")
  result = run_backend_hook("get_requires_for_build_wheel", env)
  if result.returncode == 0:
    assert "nvidia-cuda-nvcc" not in result.stdout  # NVIDIA's compiler is installed here
    pytest.skip("NVIDIA's compiler from PyPI is importable here")
  assert result.returncode == 1
  assert result.stderr.strip().count("\n") == 0, result.stderr
  assert result.stderr.startswith("clipjax: no CUDA compiler"), result.stderr
  # A CPU-only build needs no compiler, offline or not.
  env["CLIPJAX_CUDA"] = "0"
  result = run_backend_hook("get_requires_for_build_wheel", env)
  assert result.returncode == 0, result.stderr
  assert "nvidia-cuda-nvcc" not in result.stdout and "jaxlib" in result.stdout


def test_a_source_distribution_needs_no_compiler_or_jax():
  result = run_backend_hook("get_requires_for_build_sdist", dict(os.environ, PIP_NO_INDEX="1"))
  assert result.returncode == 0, result.stderr
  assert "nvidia" not in result.stdout and "jax" not in result.stdout, result.stdout


# --- pip's choice between variants -------------------------------------------------------

def a_wheel(folder: Path, variant: str, platform: str = "linux_x86_64") -> Path:
  """An empty clipjax wheel of this version, named as the build names `variant`'s."""
  tag = load_build_support().build_tag(variant)
  python = f"cp{sys.version_info.major}{sys.version_info.minor}"
  version = clipjax._version.VERSION
  path = folder / f"clipjax-{version}-{tag}-{python}-{python}-{platform}.whl"
  info = f"clipjax-{version}.dist-info"
  with zipfile.ZipFile(path, "w") as wheel:
    wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: clipjax\nVersion: {version}\n")
    wheel.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                   f"Tag: {python}-{python}-{platform}\nBuild: {tag}\n")
    wheel.writestr(f"{info}/RECORD", "")
  return path


def pip_picks(folder: Path, requirement: str = "clipjax") -> str:
  report = folder / "report.json"
  subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                  "--no-deps", "--no-index", "--find-links", str(folder), "--report",
                  str(report), "--quiet", requirement],
                 check=True, capture_output=True, text=True, timeout=300,
                 env=dict(os.environ, PIP_CONSTRAINT="", PIP_CONFIG_FILE=os.devnull))
  return Path(json.loads(report.read_text())["install"][0]["download_info"]["url"]).name


@pytest.mark.parametrize("requirement", ["clipjax", f"clipjax=={clipjax._version.VERSION}"])
def test_pip_installs_the_cuda_build_from_a_wheelhouse_of_both(tmp_path, requirement):
  for variant in ("cpu", "cu12", "cu13"):
    a_wheel(tmp_path, variant)
  assert "-13cuda-" in pip_picks(tmp_path, requirement)
  (tmp_path / pip_picks(tmp_path)).unlink()
  assert "-12cuda-" in pip_picks(tmp_path, requirement)


def test_a_release_wheel_wins_over_a_local_cpu_build(tmp_path):
  a_wheel(tmp_path, "cpu")
  a_wheel(tmp_path, "cu13", platform="manylinux_2_28_x86_64")
  assert "-13cuda-" in pip_picks(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="NVIDIA's compiler is fetched on Linux alone")
def test_pip_offline_without_a_compiler_prints_the_one_line(tmp_path):
  """`pip wheel .` with PIP_NO_INDEX=1, no nvcc, and the build system's own packages in a
  find-links folder (fetched first: skipped where PyPI is out of reach)."""
  links = tmp_path / "links"
  fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(links),
                            "scikit-build-core>=0.10"], capture_output=True, timeout=300)
  if fetched.returncode != 0:
    pytest.skip("scikit-build-core cannot be fetched here")
  no_nvcc = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                            if not os.path.isfile(os.path.join(d, "nvcc")))
  env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_HOME", "CUDA_PATH",
                                                          "CLIPJAX_CUDA", "PIP_CONSTRAINT")}
  env.update(PATH=no_nvcc, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links),
             PIP_CONFIG_FILE=os.devnull)
  result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                           str(tmp_path / "out"), str(ROOT)], capture_output=True, text=True,
                          env=env, timeout=600)
  assert result.returncode != 0
  lines = [line.strip() for line in result.stdout.splitlines() + result.stderr.splitlines()
           if line.strip().startswith("clipjax: ")]
  assert len(lines) == 1, result.stdout + result.stderr
  assert "no CUDA compiler" in lines[0] and "CLIPJAX_CUDA=0" in lines[0]
