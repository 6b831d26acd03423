"""The benchmark entry points and the sanitizers' driver, run end to end on the CPU: each
benchmark's --quick run prints its tables and writes JSON whose numbers agree with each
other and whose clips agree with float64 (and so with optax's)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from benchlib import clips, profiling, timing, trees
from conftest import load_script
from watched import run_watched

ROOT = pathlib.Path(__file__).resolve().parents[1]


# What every benchmark's JSON record holds beside its numbers (benchlib.record).
RECORD = {"command", "date", "git_commit", "device_kinds", "python", "jax", "jaxlib", "optax",
          "clipjax", "settings", "complete"}


def run_quick(script, tmp_path, *args, **env):
  """Runs `script --quick` (a path from the repository's root); returns (its JSON, its
  stdout), the JSON checked to be a whole record of this command."""
  out = tmp_path / "out.json"
  run = run_watched([sys.executable, script, "--quick", "--out", str(out),
                     *args], cwd=ROOT, env=dict(os.environ, **env))
  assert run.returncode == 0, run.stdout[-12000:]
  results = json.loads(out.read_text())
  assert RECORD <= set(results["meta"]), RECORD - set(results["meta"])
  assert results["meta"]["command"].startswith(f"python {script} --quick --out {out}")
  return results, run.stdout


def find(rows, **keys):
  [row] = [r for r in rows if all(r[k] == v for k, v in keys.items())]
  return row


@pytest.mark.slow  # a whole benchmark run, a minute or more
def test_bench_clip_quick(tmp_path):
  results, stdout = run_quick("benchmarks/bench_clip.py", tmp_path)
  meta = results["meta"]
  assert meta["complete"] and meta["passed"] and meta["andrea_impl_arg"] == "ffi"
  assert "CLIP ALONE" in stdout and "correctness: PASS" in stdout
  # Each clip agrees with float64, optax's too in f32: the custom call's result is optax's.
  for dtype in ("f32", "bf16"):
    for impl in ("ffi", "jax", "optax"):
      check = find(results["checks"], dtype=dtype, impl=impl)
      assert check["value"] <= clips.UPDATE_RTOL[dtype]
  bw = meta["copy_bandwidth_GBps"]["jax"] * 1e9
  case = trees.Case.make("tiny", "f32", 0)
  assert results["models"]["tiny"] == {"params": case.params, "leaves": case.leaves}
  for row in results["clip"]:
    assert row["regime_ok"]
    bytes_moved = row["grad_bytes"] * (3 if row["regime"] == "clip" else 1)
    assert row["floor_us"] == pytest.approx(bytes_moved / bw * 1e6)
    assert row["x_floor"] == pytest.approx(row["us_injit"] / row["floor_us"])
    optax_row = find(results["clip"], dtype=row["dtype"], regime=row["regime"], impl="optax")
    assert row["speedup_vs_optax"] == pytest.approx(optax_row["us_injit"] / row["us_injit"])
  assert {(r["dtype"], r["regime"], r["impl"]) for r in results["clip"]} == {
      (d, g, i) for d in ("f32", "bf16") for g in ("clip", "noclip")
      for i in ("ffi", "jax", "optax")}


@pytest.mark.slow  # a whole benchmark run, a minute or more
def test_bench_step_quick(tmp_path):
  results, stdout = run_quick("benchmarks/bench_step.py", tmp_path, "--dtypes", "f32",
                              "--optimizers", "adamw,inject_adamw", "--clips",
                              "none,andrea,andrea_kernel,andrea_jax,optax")
  meta = results["meta"]
  assert meta["complete"] and meta["passed"] and "TRAINING STEP" in stdout
  checks = {c["what"]: c for c in results["checks"]}
  assert checks["step andrea: first moment vs float64"]["ok"]
  assert checks["step: parameters, scale=fused vs scale=kernel (elementwise)"]["ok"]
  bw = meta["copy_bandwidth_GBps"] * 1e9
  rows = results["rows"]
  assert {(r["regime"], r["opt"], r["clip"]) for r in rows} == {
      (g, o, c) for g in ("clip", "noclip") for o in ("adamw", "inject_adamw")
      for c in ("none", "andrea", "andrea_kernel", "andrea_jax", "optax")}
  for row in rows:
    assert row["us_injit"] > 0 and row["floor_us"] == pytest.approx(10 * row["n_bytes"] / bw * 1e6)
    alone = find(rows, regime=row["regime"], opt=row["opt"], clip="none")
    if row["clip"] != "none":
      assert row["clip_us"] == pytest.approx(row["us_injit"] - alone["us_injit"])
    if row["clip"].startswith("andrea"):
      assert row["clipped_last_step"] == (row["regime"] == "clip")
    optax_row = find(rows, regime=row["regime"], opt=row["opt"], clip="optax")
    assert row["vs_optax"] == pytest.approx(optax_row["us_injit"] / row["us_injit"])


@pytest.mark.slow  # a whole benchmark run, a minute or more
def test_bench_sharded_quick_on_two_cpu_devices(tmp_path):
  flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
  results, stdout = run_quick("benchmarks/bench_sharded.py", tmp_path, XLA_FLAGS=flags,
                              JAX_PLATFORMS="cpu")
  meta = results["meta"]
  assert meta["device_count"] == 2 and meta["passed"] and meta["complete"]
  assert "SHARDED CLIP" in stdout and "FSDP TRAINING STEP" in stdout
  assert {r["impl"] for r in results["rows"]} == {"plain", "plain_jax", "andrea", "jax",
                                                 "optax", "single"}
  single = find(results["rows"], impl="single")
  for row in results["rows"]:
    assert row["regime_ok"]
    assert row["floor_us"] == pytest.approx(3 * row["device_bytes"] / meta["copy_bandwidth_GBps"]
                                            / 1e3)
    if row["impl"] != "single":  # every tiny leaf has a dimension 2 divides: half on each
      assert row["device_bytes"] * 2 == single["device_bytes"]
      assert row["speedup_vs_single"] == pytest.approx(single["us_injit"] / row["us_injit"])
  # the custom call's rows hold clipjax's custom calls and no gradient-sized collective
  for impl in ("plain", "andrea"):
    hlo = find(results["rows"], impl=impl)["hlo"]
    assert hlo["custom_calls"] > 0 and set(hlo["collectives"]) == {"all-reduce"}
  checks = {c["what"]: c for c in results["checks"]}
  assert checks["step andrea: first moment vs float64"]["ok"]
  assert checks["step: parameters, andrea vs optax chain (normwise)"]["ok"]
  # the training step: both chains, per-device memory of the compiled step
  params_bytes = 4 * meta["params"] // 2  # f32, half on each device
  for chain in ("andrea", "optax"):
    step = find(results["steps"], chain=chain)
    assert step["us_injit"] > 0 and step["learning_rate"] == 1e-4 and step["max_norm"] == 1.0
    # arguments: params, both moments and the gradients, plus a few scalars of state
    assert 4 * params_bytes <= step["memory"]["argument_bytes"] < 4 * params_bytes + 1024
    assert step["memory"]["peak_bytes"] >= step["memory"]["argument_bytes"]
  assert find(results["steps"], chain="optax")["speedup_vs_optax"] == 1.0


def test_bench_compile_quick(tmp_path):
  results, stdout = run_quick("benchmarks/bench_compile.py", tmp_path)
  assert "COMPILE TIME" in stdout
  assert [(r["round"], r["leaves"], r["impl"], r["status"]) for r in results["rows"]] == [
      (0, 10, "ffi", "ok"), (0, 10, "jax", "ok"), (0, 10, "optax", "ok"),
      (0, 10, "floor", "ok")]
  assert all(r["compile_s"] > 0 and r["peak_rss_gb"] > 0 for r in results["rows"])
  assert "GOALS" in stdout
  rows = {r["impl"]: r for r in results["rows"]}
  goals = {g["what"]: g for g in results["goals"]}
  assert set(goals) == {"custom call / floor, time", "custom call / floor, memory",
                        "pure JAX / optax, time"}
  assert goals["custom call / floor, memory"]["ratio"] == pytest.approx(
      rows["ffi"]["peak_rss_gb"] / rows["floor"]["peak_rss_gb"])
  assert goals["pure JAX / optax, time"]["met"] == (
      rows["jax"]["compile_s"] <= rows["optax"]["compile_s"])


def test_bench_compile_goals_take_the_median_of_paired_rounds():
  """With --rounds, each ratio pairs the two cases of one round, and the goal is judged on
  the median: one slow round of the floor cannot pass the custom call alone. A round in
  which either case failed is left out."""
  import bench_compile  # noqa: PLC0415

  def row(k, impl, seconds, gb=1.0, status="ok"):
    return {"leaves": 20000, "impl": impl, "round": k, "compile_s": seconds,
            "peak_rss_gb": gb, "status": status}

  rows = [row(0, "floor", 20.0), row(0, "ffi", 40.0, 1.2), row(1, "ffi", 30.0, 1.2),
          row(1, "floor", 25.0), row(2, "floor", 60.0), row(2, "ffi", 45.0, 1.2),
          row(3, "floor", None, status="over 900 s"), row(3, "ffi", 1.0)]
  time_goal, memory_goal = bench_compile.goals(rows)
  assert time_goal["what"] == "custom call / floor, time"
  assert time_goal["ratios"] == [2.0, 1.2, 0.75] and time_goal["ratio"] == 1.2
  assert time_goal["met"] and time_goal["goal"] == 1.6
  assert memory_goal["ratio"] == pytest.approx(1.2) and memory_goal["met"]
  assert not bench_compile.goals(rows[:2])[0]["met"]  # one round: its own ratio, 2.0
  with pytest.raises(SystemExit):
    bench_compile.main(["--rounds", "0"])


def test_bench_compile_without_result_names(tmp_path, monkeypatch):
  """The diagnostic lowers without JAX's per-output names, and only that changes."""
  import jax  # noqa: PLC0415
  from jax._src.interpreters import mlir  # noqa: PLC0415

  import bench_compile  # noqa: PLC0415

  tree = [jax.numpy.ones(3), jax.numpy.ones(4)]
  named = jax.jit(lambda t: [x * 2 for x in t]).lower(tree).as_text()
  assert named.count("jax.result_info") == 2
  monkeypatch.setattr(mlir, "lower_jaxpr_to_fun", mlir.lower_jaxpr_to_fun)  # restored after
  bench_compile.drop_result_names()
  unnamed = jax.jit(lambda t: [x * 3 for x in t]).lower(tree).as_text()
  assert "jax.result_info" not in unnamed and unnamed.count("stablehlo.multiply") == 2
  results, stdout = run_quick("benchmarks/bench_compile.py", tmp_path, "--impls", "floor",
                              "--without-result-names")
  assert "WITHOUT per-output names" in stdout
  [row] = results["rows"]
  assert row["status"] == "ok" and row["result_names"] is False


def test_bench_pure_jax_quick(tmp_path):
  results, stdout = run_quick("benchmarks/bench_pure_jax.py", tmp_path)
  assert "PURE JAX AGAINST OPTAX" in stdout
  rows = results["rows"]
  assert [r["what"] for r in rows] == [
      "pure JAX norm, by rows", "pure JAX norm, whole leaves", "optax norm",
      "pure JAX clip, by rows", "pure JAX clip, whole leaves", "optax clip"]
  assert all(r["wall_us"] > 0 and r["device_us"] is None for r in rows)  # a CPU: no trace


def test_bench_dispatch_quick(tmp_path):
  results, stdout = run_quick("benchmarks/bench_dispatch.py", tmp_path)
  assert "HOST TIME PER JITTED CALL" in stdout
  rows = {r["layout"]: r for r in results["rows"]}
  assert {k: r["state_arrays"] for k, r in rows.items()} == {
      "none": 0, "one scalar": 1, "andrea_clip's state": 9, "its fields in two arrays": 2,
      "30 scalars": 30}
  assert rows["none"]["paired_vs_none"] == 1 and rows["none"]["us_per_added_array"] is None
  for row in rows.values():
    host = row["host_us"]
    assert len(host["rounds"]) == 3 and 0 < host["min"] <= host["median"] <= host["max"]


@pytest.mark.slow  # a whole benchmark run, a minute or more
def test_example_benchmark_quick(tmp_path):
  hlo_dir = tmp_path / "hlo"
  results, stdout = run_quick("examples/benchmark.py", tmp_path, "--hlo-dir", str(hlo_dir),
                              "--kernels", "3")
  assert results["meta"]["complete"] and "REAL TRAINING STEP" in stdout
  rows = results["rows"]
  variants = ("none", "none_again", "andrea", "andrea_kernel", "andrea_jax", "optax")
  assert sorted((r["dtype"], r["variant"]) for r in rows) == sorted(
      (d, v) for d in ("f32", "bf16") for v in variants)
  assert set(results["skipped"]) == {"torch_adamw", "torch_clip"}  # torch needs a GPU
  for row in rows:
    wall, dispatch = row["wall_ms"], row["dispatch_ms"]
    assert all(0 < d <= w for d, w in zip(dispatch["rounds"], wall["rounds"]))
    assert wall["min"] <= wall["median"] <= wall["max"]
    assert len(row["host_ms"]["rounds"]) == len(wall["rounds"]) and row["host_ms"]["min"] > 0
    alone = find(rows, dtype=row["dtype"], variant="none")
    assert row["wall_vs_adamw"] == pytest.approx(wall["median"] / alone["wall_ms"]["median"])
    paired = [w / a for w, a in zip(wall["rounds"], alone["wall_ms"]["rounds"])]
    assert row["wall_paired_vs_adamw"]["rounds"] == pytest.approx(paired)
    paired = [h / a for h, a in zip(row["host_ms"]["rounds"], alone["host_ms"]["rounds"])]
    assert row["host_paired_vs_adamw"]["rounds"] == pytest.approx(paired)
    assert row["device_ms"] is None and row["hlo"]["fusions"] > 0  # a CPU: no trace
    assert row["device_us_by_kernel"] == {}
    hlo = (hlo_dir / f"tiny-b2-{row['dtype']}-{row['variant']}.hlo.txt").read_text()
    assert "HloModule" in hlo and row["hlo"]["call_operands"] == profiling.call_operands(hlo)
    if row["variant"] == "none_again":  # the control: the same program, timed apart
      assert row["hlo"] == alone["hlo"] and row["wall_ms"]["rounds"] != alone["wall_ms"]["rounds"]
    if row["variant"].startswith("andrea"):
      assert row["global_norm"] > 0
  # Each clip's step and the control against the targets, on their paired ratios.
  for v in results["targets"]:
    low, high, coverage = v["interval"]  # 6 rounds: the lowest and highest, 97% coverage
    assert low <= v["median"] <= high and coverage >= 0.95
    assert v["verdict"] == timing.verdict(v["interval"], v["bound"])
  assert {(v["dtype"], v["variant"], v["target"]) for v in results["targets"]} == {
      (d, c, t) for d in ("f32", "bf16") for c in variants[2:]
      for t in ("wall vs adamw alone", "wall vs optax's chain", "host vs adamw alone")
      if c != "optax"} | {(d, "none_again", t) for d in ("f32", "bf16")
                          for t in ("wall vs adamw alone", "host vs adamw alone")}
  assert "targets (paired ratio, its 95% interval, the bound)" in stdout


def test_torch_gpt_is_the_example_model():
  """examples/benchmark.py's torch rows run the example's GPT: with the JAX model's weights
  copied in leaf for leaf, the torch model gives the same logits, and its step (the clip,
  then AdamW) moves every leaf."""
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from benchlib import torch_gpt
  from gpt import model as model_lib

  cfg = model_lib.ModelConfig(num_layers=2, d_model=64, num_heads=4, vocab_size=300,
                              context_length=16)
  gpt = model_lib.GPT(cfg, nnx.Rngs(0))
  torch_model = torch_gpt.build_gpt(torch, cfg, "cpu")
  leaves = dict(torch_model.named_parameters())
  renames = ((".attn.", "."), (".mlp.", "."), ("embedding", "weight"), ("kernel", "weight"),
             ("scale", "weight"))
  with torch.no_grad():
    for path, value in nnx.to_flat_state(nnx.state(gpt, nnx.Param)):
      name = ".".join(map(str, path))
      for old, new in renames:
        name = name.replace(old, new)
      value = np.asarray(value[...])
      leaves.pop(name).copy_(torch.from_numpy(np.array(value.T if path[-1] == "kernel"
                                                       else value)))
  assert not leaves  # every torch leaf has its JAX leaf
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.context_length + 1))
  want = np.asarray(gpt(jnp.asarray(tokens[:, :-1])))
  got = torch_model(torch.as_tensor(tokens[:, :-1])).detach().numpy()
  np.testing.assert_allclose(got, want, atol=2e-6)
  before = [p.detach().clone() for p in torch_model.parameters()]
  torch_gpt.make_step(torch, torch_model, clip_norm=1.0, learning_rate=1e-3, weight_decay=0.1,
                      autocast=False)(torch.as_tensor(tokens))
  assert all(not torch.equal(b, p) for b, p in zip(before, torch_model.parameters()))


def sanitize_kernels():
  return load_script("scripts/sanitize_kernels.py")


def test_sanitize_kernels_passes_every_case_on_the_cpu_handler():
  # The script the GPU sanitizers run: on a CPU it drives the custom calls' CPU handlers
  # through the same cases, each against float64 NumPy.
  names = [name for name, _ in sanitize_kernels().all_cases()]
  run = run_watched([sys.executable, "scripts/sanitize_kernels.py"], cwd=ROOT,
                    env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-8000:]
  assert [line[4:].strip() for line in run.stdout.splitlines()
          if line.startswith("ok  ")] == names
  assert "all cases pass" in run.stdout


def test_sanitizer_groups_hold_every_case_once():
  module = sanitize_kernels()
  listed = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", "--groups"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
  groups = listed.stdout.split("\n")[:-1]
  assert groups == list(module.GROUPS)
  in_groups = [name for group in groups for name in group.split(",")]
  assert sorted(in_groups) == sorted(name for name, _ in module.all_cases())
