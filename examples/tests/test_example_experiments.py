"""The experiment scripts (examples/experiments/): the spike and lock-in rules, tiny runs."""

import argparse
import json
import os

import numpy as np
import pytest

from gpt import config
import exp_common
import exp_fallback_vs_cuda
import exp_lr_sweep
import exp_v1_vs_v2
from gpt import model as model_lib
from gpt.reports import metrics
from gpt.training import loop

# The tiny model on a small vocabulary, short context and small batch.
TINY = ["--batch-size", "4", "--context-length", "32", "--vocab-size", "512",
        "--max-source-mb", "0.05", "--no-progress"]
RULES = argparse.Namespace(spike_factor=5.0, spike_window=50, boundary_radius=3, lock_in=0.5)



def synthetic_run(norms, boundary_steps, max_norm=1.0, repetition=None):
  records = [{"kind": "phase", "step": 1, "phase": 0}]
  records += [{"kind": "phase", "step": b, "phase": i + 1} for i, b in enumerate(boundary_steps)]
  records += [{"kind": "step", "step": s, "loss": 5.0, "grad_norm": n,
               "clipped": n > max_norm > 0} for s, n in enumerate(norms, start=1)]
  records.sort(key=lambda r: (r["step"], r["kind"] == "step"))
  return {"records": records,
          "config": {"config": "andrea-120m", "recipe": "v1", "clip_mode": "global",
                     "max_norm": max_norm, "warmup_steps": 0, "batch_size": 16,
                     "context_length": 1024, "sources": [], "seed": 0},
          "environment": {"command": "python", "device": "cpu", "platform": "cpu",
                          "jax": "0", "date": "today"},
          "summary": {"repetition": repetition or {}, "samples": []}}


# --- The rules, on exact cases ------------------------------------------------------


def test_a_spike_is_five_times_the_running_median_and_near_means_within_three_steps():
  norms = [1.0] * 100
  norms[30 - 1] = 6.0  # step 30, two steps after the boundary at 28: near
  norms[70 - 1] = 6.0  # step 70, far from every boundary
  norms[50 - 1] = 4.9  # below 5x: not a spike
  norms[5 - 1] = 99.0  # too early to test: fewer than 10 earlier norms
  a = exp_v1_vs_v2.analyse(synthetic_run(norms, [28, 90]), RULES)
  assert a["spike_steps"] == [30, 70]
  assert (a["spikes_near_boundary"], a["spikes_elsewhere"]) == (1, 1)
  # Steps 11..100 are testable; 25..31 and 87..93 are near: 14 of 90.
  assert a["near_boundary_share_of_steps"] == pytest.approx(14 / 90)
  assert a["expected_near_if_uniform"] == pytest.approx(2 * 14 / 90)
  assert a["largest_norm"] == 99.0 and a["largest_norm_step"] == 5
  assert a["clipped_share"] == pytest.approx(4 / 100)


def test_spikes_at_every_boundary_are_called_clustered():
  boundaries = list(range(20, 200, 20))
  norms = [1.0] * 200
  for b in boundaries:
    norms[b - 1] = 10.0
  a = exp_v1_vs_v2.analyse(synthetic_run(norms, boundaries), RULES)
  assert a["spikes_near_boundary"] == len(boundaries) and a["p_value_near"] < 1e-3
  assert "cluster at the source switches" in exp_v1_vs_v2.spike_sentence("x", a, RULES)


@pytest.mark.parametrize("big, small, verdict", [
    (0.9, 0.1, "Reproduced: v1 at andrea-120m locked in"),
    (0.2, 0.1, "Not reproduced: v1 at andrea-120m shows no lock-in"),
    (0.9, 0.8, "Not reproduced: v1 fails at both sizes")])
def test_the_size_claim_is_judged_from_the_repetition_metrics(big, small, verdict):
  def v1(share):
    rep = {"top_token_share": share, "repeat_4": 0.0, "distinct_2": 1.0}
    return exp_v1_vs_v2.analyse(synthetic_run([1.0] * 20, [], 0.0, rep), RULES)

  findings = exp_v1_vs_v2.lock_in_findings(
      {"andrea-12m-v1": v1(small), "andrea-120m-v1": v1(big)}, RULES)
  assert findings[0].startswith(verdict)
  assert verdict.startswith("Reproduced") != any(f.startswith("Why that may be") for f in findings)


# --- Tiny runs of the scripts -------------------------------------------------------


@pytest.mark.slow
def test_fallback_vs_ffi_on_the_cpu(tmp_path, cache_dir):
  out = tmp_path / "fallback"
  results = exp_fallback_vs_cuda.main(
      ["--configs", "tiny", "--steps", "5", "--time-configs", "tiny", "--time-steps", "2",
       "--time-warmup", "1", "--out-dir", str(out), "--cache-dir", cache_dir, *TINY])
  assert {"report.md", "results.json", "tiny-equivalence.png", "timing.png"} <= set(
      os.listdir(out))
  with open(out / "results.json") as f:
    assert set(json.load(f)) == {"environment", "clip_impls", "run_labels", "equivalence",
                                 "timing"}
  d = results["equivalence"]["tiny"]["ffi"]
  assert d["steps"] == 5
  assert d["max_norm_rel_diff"] < 1e-5  # the CPU handler and pure JAX: one norm
  assert d["clipped_mismatch_count"] == 0
  t = results["timing"]["tiny"]
  assert set(t["step_ms"]) == {"no clip", "jax", "ffi"}
  # The timed model is the tiny one on the run's vocabulary and context.
  _, params = loop.init_model(config.resolve(
      config.TrainConfig(config="tiny", vocab_size=512, context_length=32)))
  assert t["params"] == model_lib.count_params(params)
  report = (out / "report.md").read_text()
  for impl in ("jax", "ffi"):  # the table shows the measured times
    step, alone = t["step_ms"][impl], t["clip_alone_ms"][impl]["clips"]
    assert f"| tiny | {impl} | {t['step_ms']['no clip']:.3g} | {step:.3g} |" in report
    assert f"| {alone:.3g} ({100 * alone / step:.1f}%) |" in report


def test_a_repeated_impl_is_a_control_run(tmp_path, cache_dir):
  out = tmp_path / "control"
  argv = ["--configs", "tiny", "--steps", "4", "--clip-impls", "jax,ffi,jax",
          "--time-configs", "", "--out-dir", str(out), "--cache-dir", cache_dir, *TINY]
  results = exp_fallback_vs_cuda.main(argv)
  assert results["run_labels"] == ["jax", "ffi", "jax-2"]
  assert {"tiny-jax", "tiny-ffi", "tiny-jax-2"} <= set(os.listdir(out))
  control = results["equivalence"]["tiny"]["jax-2"]
  # On the CPU a run is reproducible: the control drifts by nothing at all.
  assert control["max_norm_rel_diff"] == 0.0 and control["max_loss_abs_diff"] == 0.0
  assert "`jax-2` repeats an impl" in (out / "report.md").read_text()
  # Its runs are not trained over again unless asked to.
  with pytest.raises(config.ConfigError, match=f"--out-dir {out / 'tiny-jax'} holds an "
                     "earlier run .* or --overwrite to replace it"):
    exp_fallback_vs_cuda.main(argv)


@pytest.mark.slow
def test_v1_vs_v2_with_per_tensor(tmp_path, cache_dir):
  out = tmp_path / "v1v2"
  args = ["--configs", "tiny", "--per-tensor-configs", "tiny", "--steps", "12",
          "--num-samples", "1", "--sample-tokens", "8", "--out-dir", str(out),
          "--cache-dir", cache_dir, *TINY]
  results = exp_v1_vs_v2.main(args)
  assert {"report.md", "results.json", "tiny.png"} <= set(os.listdir(out))
  with open(out / "results.json") as f:
    assert set(json.load(f)) == {"environment", "definitions", "runs", "size_claim"}
  runs = results["runs"]
  assert set(runs) == {"tiny-v1", "tiny-v2", "tiny-v2-zscore", "tiny-v2-skip",
                       "tiny-v2-per-tensor"}
  assert [runs[f"tiny-{v}"]["spike_policy"] for v in ("v2", "v2-zscore", "v2-skip")] == [
      "off", "zscore", "skip"]
  assert runs["tiny-v1"]["clipped_share"] is None
  v2_steps = metrics.step_records(metrics.read_records(str(out / "tiny-v2" / "metrics.jsonl")))
  assert runs["tiny-v2"]["clipped_share"] == pytest.approx(
      sum(r["clipped"] for r in v2_steps) / 12)
  assert runs["tiny-v2-per-tensor"]["clip_mode"] == "per_tensor"
  for a in runs.values():
    assert a["steps"] == a["planned_steps"] == 12 and len(a["samples"]) == 1
    assert a["stopped_by_time_limit"] is False
    assert set(a["repetition"]) == {"distinct_2", "repeat_4", "top_token_share"}
  report = (out / "report.md").read_text()
  assert "tiny, global vs per-tensor clipping" in report
  # The report can be rebuilt from the run directories alone.
  rebuilt = exp_v1_vs_v2.main(args + ["--report-only"])
  assert rebuilt["runs"]["tiny-v2"]["final_loss"] == runs["tiny-v2"]["final_loss"]


def test_a_run_cut_short_by_its_time_limit_resumes_and_a_finished_one_is_kept(tmp_path,
                                                                              cache_dir):
  out = tmp_path / "resume"
  args = ["--configs", "tiny", "--variants", "v2", "--per-tensor-configs", "",
          "--steps", "6", "--num-samples", "0", "--out-dir", str(out),
          "--cache-dir", cache_dir, *TINY]
  cut = exp_v1_vs_v2.main(args + ["--time-limit-s", "1e-6"])["runs"]["tiny-v2"]
  assert cut["steps"] == 1 and cut["stopped_by_time_limit"]
  run_dir = out / "tiny-v2"
  assert exp_common.run_state(str(run_dir)) == "cut short"
  assert os.listdir(run_dir / "checkpoints")  # kept for --resume
  whole = exp_v1_vs_v2.main(args + ["--resume"])["runs"]["tiny-v2"]
  assert whole["steps"] == 6 and not whole["stopped_by_time_limit"]
  steps = [r["step"] for r in metrics.step_records(
      metrics.read_records(str(run_dir / "metrics.jsonl")))]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert exp_common.run_state(str(run_dir)) == "finished"
  assert not (run_dir / "checkpoints").exists()
  # A finished run is not trained again by --resume.
  mtime = os.path.getmtime(run_dir / "metrics.jsonl")
  exp_v1_vs_v2.main(args + ["--resume"])
  assert os.path.getmtime(run_dir / "metrics.jsonl") == mtime


def test_a_diverged_run_is_an_outcome_of_the_experiment(tmp_path, cache_dir, monkeypatch):
  real_train = loop.train

  def diverge(cfg):
    records = real_train(cfg)  # a real run, then the report of a divergence
    raise loop.TrainingDiverged(f"NaN/inf for 3 steps after step {len(records)}")

  monkeypatch.setattr(loop, "train", diverge)
  out = tmp_path / "diverged"
  results = exp_v1_vs_v2.main(
      ["--configs", "tiny", "--variants", "v1", "--per-tensor-configs", "", "--steps", "3",
       "--num-samples", "0", "--out-dir", str(out), "--cache-dir", cache_dir, *TINY])
  assert exp_common.run_state(str(out / "tiny-v1")) == "diverged"
  assert results["runs"]["tiny-v1"]["diverged"].startswith("NaN/inf for 3 steps")


# --- The learning-rate sweep --------------------------------------------------------


def sweep_run(losses, lr, repetition=None, diverged=None):
  run = synthetic_run([1.0] * len(losses), [], repetition=repetition)
  for r, loss in zip(metrics.step_records(run["records"]), losses):
    r["loss"] = loss
  run["config"].update(peak_lr=lr, steps=len(losses))
  if diverged:
    run["summary"]["diverged"] = diverged
  return run


SWEEP_RULES = argparse.Namespace(blowup=1.0, lock_in=0.5, worse_by=1.0)
CALM = {"top_token_share": 0.1, "repeat_4": 0.05, "distinct_2": 0.9}


@pytest.mark.parametrize("losses, repetition, diverged, outcome", [
    (list(np.linspace(8, 4, 200)), CALM, None, "stable"),
    (list(np.linspace(8, 4, 100)) + list(np.linspace(4, 6, 100)), CALM, None, "diverged"),
    (list(np.linspace(8, 4, 100)) + list(np.linspace(4, 4.8, 100)), CALM, None, "stable"),
    (list(np.linspace(8, 4, 100)) + [float("nan")] * 3, {}, "NaN/inf", "diverged"),
    (list(np.linspace(8, 4, 200)), {**CALM, "repeat_4": 0.7}, None, "locked in")])
def test_a_sweep_run_is_judged_stable_diverged_or_locked_in(losses, repetition, diverged,
                                                             outcome):
  j = exp_lr_sweep.judge(sweep_run(losses, 1e-3, repetition, diverged), SWEEP_RULES)
  assert j["outcome"] == outcome


def test_a_rate_above_the_best_that_trains_a_nat_worse_is_too_high():
  lowest = {3e-4: 4.5, 1e-3: 3.0, 3e-3: 2.5, 1e-2: 3.6, 3e-2: 3.4}
  judged = {lr: {"config": "c", "variant": "v1", "peak_lr": lr, "outcome": "stable",
                 "why": "", "lowest_smoothed_loss": loss} for lr, loss in lowest.items()}
  judged[1e-1] = {**judged[3e-2], "peak_lr": 1e-1, "outcome": "diverged",
                  "lowest_smoothed_loss": 9.0}
  exp_lr_sweep.mark_too_high(judged, 1.0)
  # 3e-4 trains 2 nats worse, but below the best rate: too slow, not too high.
  assert {lr: j["outcome"] for lr, j in judged.items()} == {
      3e-4: "stable", 1e-3: "stable", 3e-3: "stable", 1e-2: "too high", 3e-2: "stable",
      1e-1: "diverged"}
  assert judged[1e-2]["why"] == "lowest loss 1.10 nats above 0.003's"


def test_the_stable_range_is_the_largest_stable_rate_and_the_failure_above_it():
  def judged(outcomes):
    return {f"x-{lr}": {"config": "andrea-12m", "variant": "v1", "peak_lr": lr,
                        "outcome": o} for lr, o in outcomes.items()}

  r = exp_lr_sweep.stable_range(judged({1e-4: "stable", 1e-3: "stable", 1e-2: "diverged",
                                        3e-2: "locked in"}))["andrea-12m v1"]
  assert r["largest_stable"] == 1e-3
  assert r["first_failure_above"] == {"peak_lr": 1e-2, "outcome": "diverged"}
  assert "stable up to 0.001; 0.01 diverged" in exp_lr_sweep.range_sentence("v1", r)
  # A stable rate above a failure still counts: the edge is not always clean.
  r = exp_lr_sweep.stable_range(judged({1e-3: "locked in", 1e-2: "stable"}))["andrea-12m v1"]
  assert r == {"tried": [1e-3, 1e-2], "largest_stable": 1e-2, "first_failure_above": None}
  assert "the edge lies above 0.01" in exp_lr_sweep.range_sentence("v1", r)


@pytest.mark.slow
def test_lr_sweep_on_the_cpu(tmp_path, cache_dir):
  out = tmp_path / "sweep"
  args = ["--configs", "tiny", "--variants", "v1,v2", "--lrs", "1e-3,3e-3", "--steps", "6",
          "--warmup-steps", "2",
          "--num-samples", "1", "--sample-tokens", "8", "--out-dir", str(out),
          "--cache-dir", cache_dir, *TINY]
  results = exp_lr_sweep.main(args)
  assert set(results["runs"]) == {"tiny-v1-lr0.001", "tiny-v1-lr0.003", "tiny-v2-lr0.001",
                                  "tiny-v2-lr0.003"}
  assert {"report.md", "results.json", "tiny-lr.png"} <= set(os.listdir(out))
  for name, j in results["runs"].items():
    assert j["steps"] == 6 and j["peak_lr"] == float(name.split("-lr")[1])
    assert j["outcome"] in ("stable", "too high", "diverged", "locked in")
  for variant, warmup in (("v1", 0), ("v2", 2)):  # v1's recipe has none, whatever the flag
    with open(out / f"tiny-{variant}-lr0.003" / "config.json") as f:
      assert json.load(f)["warmup_steps"] == warmup
  assert set(results["stable_range"]) == {"tiny v1", "tiny v2"}
  assert "## Stable range" in (out / "report.md").read_text()
  with pytest.raises(SystemExit):
    exp_lr_sweep.parse_args(args + ["--peak-lr", "1e-3"])
