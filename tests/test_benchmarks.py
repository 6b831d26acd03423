"""The benchmark scripts run end to end (--quick: tiny shapes, on the CPU too) and write
their JSON: the GPU runs use the same code paths."""

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
