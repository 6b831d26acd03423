"""The scripts the GPU runs use, run end to end on the CPU: the benchmarks (--quick: tiny
shapes) write their JSON, and the sanitizers' driver checks every case."""

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


def test_sanitize_kernels_script_passes_on_the_cpu_handler():
  # The script the GPU sanitizers run: on a CPU it drives the custom call's CPU handler
  # through the same cases and checks every result against float64 NumPy.
  run = subprocess.run([sys.executable, "scripts/sanitize_kernels.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert "all cases pass" in run.stdout and "FAIL" not in run.stdout
  assert run.stdout.count("ok  ") == 11


def _plan(tmp_path, plan, **env):
  return subprocess.run(["bash", "scripts/gpu_plan.sh", plan, str(tmp_path / "logs")], cwd=ROOT,
                        capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, DRY_RUN="1", **env))


def test_gpu_plan_runs_stages_in_order_and_jobs_on_their_gpus(tmp_path):
  run = _plan(tmp_path, "sharded:300+bench@0,correctness@1,bench@1", BENCH_ARGS="--models gpt12m",
              BENCH_ARGS_1="--models gpt120m")
  assert run.returncode == 0, run.stdout + run.stderr
  out = run.stdout
  # the stage of "sharded" ends before the next stage's jobs start
  assert out.index("t=") < out.index("tests/test_sharded.py") < out.index("bench@0")
  assert out.index("bench@0") < out.index("correctness@1")
  bench = [line for line in out.splitlines() if "bench_clip.py" in line]
  assert len(bench) == 2 and all("--no-probe" in line for line in bench)
  assert "--models gpt12m" in bench[0] and "bench-gpu0" in bench[0]
  assert "--models gpt120m" in bench[1] and "bench-gpu1" in bench[1]
  sharded = next(line for line in out.splitlines() if "bench_sharded.py" in line)
  assert int(sharded.split()[1]) <= 300  # the job's cap bounds its timeout
  logs = tmp_path / "logs"
  assert {p.name for p in logs.iterdir()} == {"sharded", "bench-gpu0", "correctness-gpu1",
                                              "bench-gpu1"}
  assert (tmp_path / "logs.tar.gz").exists()


def test_gpu_plan_refuses_an_unknown_job_before_running_anything(tmp_path):
  for plan in ("bench+tests", "bench@x", "bench:soon"):
    run = _plan(tmp_path, plan)
    assert run.returncode == 2
    assert plan.split("+")[-1] in run.stderr and "usage" in run.stderr
    assert not (tmp_path / "logs.tar.gz").exists()


def test_clips_moving_fewer_bytes_get_more_repetitions_per_call():
  b = _bench_clip()
  cfg = b.parse_args([])
  case = {(m, d): b.Case.make(m, d, 0) for m in ("gpt120m", "gpt12m") for d in ("f32", "bf16")}
  K = lambda impl, m, d, regime: b.scaled_reps(  # noqa: E731
      {"ffi": 10, "optax": 4, "jax": 2}[impl], impl, case[m, d], regime, cfg)
  # (clips written out, passes of the loop): K moves CALL_BYTES (50 GB)
  assert K("ffi", "gpt120m", "f32", "clip") == (43, 1)  # 3 x 395 MB per clip
  assert K("ffi", "gpt120m", "f32", "noclip") == (64, 2)  # N bytes, not 3N: 127 -> 2 x 64
  assert K("ffi", "gpt12m", "bf16", "noclip") == (80, 18)  # 1425, written out 80 at a time
  assert K("optax", "gpt12m", "f32", "clip") == (16, 8)  # optax: MAX_REPS 128, 16 written out
  assert K("jax", "gpt120m", "f32", "clip") == (4, 11)
  cfg.no_scale_reps = True
  assert K("ffi", "gpt12m", "bf16", "noclip") == (10, 1)
  cfg.unroll = 4
  assert K("ffi", "gpt12m", "bf16", "noclip") == (4, 3)  # 10 -> 3 passes of 4
  cfg.no_scale_reps, cfg.unroll = False, None
  assert K("ffi", "gpt120m", "f32", "clip") == (43, 1)


def test_racecheck_groups_cover_every_sanitizer_case_once():
  import re
  script = (ROOT / "scripts" / "gpu_check.sh").read_text()
  block = script[script.index("racecheck_groups=("):]
  groups = re.findall(r'"([^"$]+)"', block[:block.index(")\n")])
  assert len(groups) == 4
  names = [n for g in groups for n in g.split(",")]
  listed = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", "no such case"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert listed.returncode == 2
  known = re.findall(r"'([^']+)'", listed.stdout.split("known:")[1])
  assert sorted(names) == sorted(known)  # every case, each in one group
  run = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", groups[0]], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0 and run.stdout.count("ok  ") == len(groups[0].split(","))


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
