"""The scripts the GPU runs use, run end to end on the CPU: the benchmarks (--quick: tiny
shapes) write their JSON, and the sanitizers' driver checks every case in its groups."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench_clip():
  """benchmarks/bench_clip.py as a module."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    import bench_clip  # noqa: PLC0415
  finally:
    sys.path.pop(0)
  return bench_clip


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
  bench_clip = _bench_clip()
  from types import SimpleNamespace as NS
  ev = lambda start, dur: NS(start_ns=start, duration_ns=dur)
  streams = [NS(name="Stream #1", events=[ev(0, 100), ev(50, 100)]),  # overlap: 0..150
             NS(name="Stream #2", events=[ev(300, 50)]),
             NS(name="XLA Modules", events=[ev(0, 10_000)])]            # spans gaps: ignored
  assert bench_clip.busy_seconds(streams) == 200e-9
  assert bench_clip.busy_seconds([NS(name="XLA Ops", events=[ev(0, 40)])]) == 40e-9
  assert bench_clip.busy_seconds([NS(name="XLA Modules", events=[ev(0, 40)])]) is None


def test_kernel_seconds_ranks_the_kernels_of_the_stream_lines():
  bench_clip = _bench_clip()
  from types import SimpleNamespace as NS
  ev = lambda name, dur: NS(name=name, start_ns=0, duration_ns=dur)  # noqa: E731
  lines = [NS(name="Stream #1", events=[ev("k_grad_scale", 300), ev("k_grad_norm_final", 50),
                                        ev("k_grad_scale", 300)]),
           NS(name="Stream #2", events=[ev("k_grad_norm_partial", 400)]),
           NS(name="XLA Ops", events=[ev("custom-call", 10_000)])]  # not a stream: ignored
  got = bench_clip.kernel_seconds(lines)
  assert list(got) == ["k_grad_scale", "k_grad_norm_partial", "k_grad_norm_final"]
  assert got["k_grad_scale"] == 600e-9 and got["k_grad_norm_final"] == 50e-9
  top1 = bench_clip.kernel_seconds(lines, top=1)
  assert top1 == {"k_grad_scale": 600e-9, "(other)": 450e-9}


@pytest.mark.parametrize("impl", ["ffi", "optax"])
def test_clips_in_a_loop_are_the_clips_written_out(impl):
  """K clips as passes of a loop (max_norms scaled down pass by pass) give the same trees as
  the K clips written out with the same max_norm schedule."""
  b = _bench_clip()
  import jax
  import numpy as np

  case = b.Case.make("tiny", "f32", 0)
  fns = b.JaxFunctions("auto")
  norm0 = float(b.f32_norm(case.random_tree(1)))
  trees = lambda: [case.random_tree(1), case.random_tree(2)]  # noqa: E731
  ms = b.max_norm_schedule("clip", norm0, 6)
  written_out = fns.clip(impl)(trees(), tuple(ms))
  looped = fns.clip(impl, 3, b.DECAY**2)(trees(), tuple(ms[:2]))
  for x, y in zip(jax.tree.leaves(written_out), jax.tree.leaves(looped)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6)
  assert all(float(b.f32_norm(t)) < norm0 / b.NORM_RATIO for t in looped)  # all clipped


def sanitize_kernels():
  spec = importlib.util.spec_from_file_location("sanitize_kernels",
                                                ROOT / "scripts" / "sanitize_kernels.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_sanitize_kernels_passes_every_case_on_the_cpu_handler():
  # The script the GPU sanitizers run: on a CPU it drives the custom calls' CPU handlers
  # through the same cases, each against float64 NumPy.
  names = [name for name, _ in sanitize_kernels().all_cases()]
  run = subprocess.run([sys.executable, "scripts/sanitize_kernels.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert [line[4:].strip() for line in run.stdout.splitlines()
          if line.startswith("ok  ")] == names
  assert "all cases pass" in run.stdout


def test_racecheck_groups_hold_every_sanitizer_case_once():
  module = sanitize_kernels()
  listed = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", "--groups"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  groups = listed.stdout.split("\n")[:-1]
  assert groups == list(module.RACECHECK_GROUPS)
  in_groups = [name for group in groups for name in group.split(",")]
  assert sorted(in_groups) == sorted(name for name, _ in module.all_cases())
