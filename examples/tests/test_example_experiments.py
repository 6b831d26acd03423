"""The experiment scripts (examples/experiments/): the spike and lock-in rules, tiny runs."""

import argparse
import json
import os

import pytest

import config
import exp_fallback_vs_cuda
import exp_v1_vs_v2
import loop
import metrics
import model as model_lib

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
