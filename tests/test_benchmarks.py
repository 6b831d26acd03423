"""The scripts the GPU runs use, run end to end on the CPU: the benchmarks (--quick: tiny
shapes) write their JSON, and the sanitizers' driver checks every case."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, tmp_path, **env):
  out = tmp_path / "out.json"
  run = subprocess.run([sys.executable, *args, "--quick", "--out", str(out)], cwd=ROOT,
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
  with open(out) as f:
    return json.load(f), run.stdout


def test_bench_clip_quick(tmp_path):
  results, stdout = _run(["benchmarks/bench_clip.py"], tmp_path)
  assert results["meta"]["complete"] is True
  impls = {row["impl"] for row in results["clip"]}
  assert {"ffi", "jax", "optax"} <= impls
  assert {row["regime"] for row in results["clip"]} == {"clip", "noclip"}
  assert all(row["us_injit"] > 0 and row["regime_ok"] for row in results["clip"])
  assert {"adamw", "ffi"} <= {row["impl"] for row in results["step"]}
  assert "andrea_clip" in stdout


def test_bench_sharded_quick_on_two_cpu_devices(tmp_path):
  flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
  results, stdout = _run(["benchmarks/bench_sharded.py"], tmp_path, XLA_FLAGS=flags,
                         JAX_PLATFORMS="cpu")
  assert "correctness: PASS" in stdout
  assert results["meta"]["device_count"] == 2 and results["meta"]["passed"] is True
  assert {row["impl"] for row in results["rows"]} >= {"andrea", "optax", "single"}


def test_busy_seconds_is_the_union_of_stream_activity():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_clip  # noqa: PLC0415
  from types import SimpleNamespace as NS
  ev = lambda start, dur: NS(start_ns=start, duration_ns=dur)
  streams = [NS(name="Stream #1", events=[ev(0, 100), ev(50, 100)]),  # overlap: 0..150
             NS(name="Stream #2", events=[ev(300, 50)]),
             NS(name="XLA Modules", events=[ev(0, 10_000)])]            # spans gaps: ignored
  assert bench_clip.busy_seconds(streams) == 200e-9
  assert bench_clip.busy_seconds([NS(name="XLA Ops", events=[ev(0, 40)])]) == 40e-9
  assert bench_clip.busy_seconds([NS(name="XLA Modules", events=[ev(0, 40)])]) is None


def test_sanitize_kernels_script_passes_on_the_cpu_handler():
  # The script the GPU sanitizers run: on a CPU it drives the custom call's CPU handler
  # through the same cases and checks every result against float64 NumPy.
  run = subprocess.run([sys.executable, "scripts/sanitize_kernels.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert "all cases pass" in run.stdout and "FAIL" not in run.stdout
  assert run.stdout.count("ok  ") == 10
