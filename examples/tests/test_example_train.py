"""The example's training program (train_gpt.py, config.py, train_step.py, loop.py), on
tiny settings."""

import dataclasses
import json
import os
import re

import clipjax
import jax
import numpy as np
import pytest

from gpt import config
from gpt.data import bandit, corpus
from gpt.reports import metrics
from gpt.training import loop
import train_gpt
from gpt.training import train_step
from examples.tests.conftest import require_repeatable_bits

NAMES = ("repo-docs", "gutenberg", "hermes3-general")



steps_of = metrics.step_records


@pytest.fixture(scope="module")
def v2_run(tmp_path_factory, tiny):
  cfg = tiny(tmp_path_factory.mktemp("v2"), plot=True, num_samples=2, sample_tokens=8)
  return config.resolve(cfg), loop.train(cfg)


# --- Settings -----------------------------------------------------------------------


def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine():
  cfg = config.resolve(config.TrainConfig(peak_lr=1e-3, warmup_steps=10, steps=110))
  lr_of_step = lambda step: float(train_step.lr_schedule(cfg)(step - 1))
  assert lr_of_step(1) == pytest.approx(1e-4)  # peak / warmup
  assert lr_of_step(5) == pytest.approx(5e-4)
  assert lr_of_step(10) == pytest.approx(1e-3)  # the peak
  assert lr_of_step(60) == pytest.approx(1e-4 + 0.5 * 0.9e-3)  # half way down the cosine
  assert lr_of_step(110) == pytest.approx(1e-4)  # peak * end_lr_ratio
  # The andrea presets' first step, as the documents give it: 3e-4 / 2000.
  andrea = config.resolve(config.TrainConfig(config="andrea-120m"))
  assert float(train_step.lr_schedule(andrea)(0)) == pytest.approx(1.5e-7)


def test_v1_recipe_is_no_clip_adam_no_warmup():
  cfg = config.resolve(config.TrainConfig(config="andrea-120m", recipe="v1"))
  assert (cfg.max_norm, cfg.weight_decay, cfg.warmup_steps) == (0.0, 0.0, 0)
  assert float(train_step.lr_schedule(cfg)(0)) == pytest.approx(3e-4, rel=1e-6)
  with pytest.raises(ValueError, match="no AndreaClipState"):
    clipjax.clip_state(train_step.make_optimizer(cfg).init({"w": np.zeros(3)}))


def test_explicit_settings_win_over_recipe_and_preset():
  cfg = config.resolve(config.TrainConfig(recipe="v1", warmup_steps=10, max_norm=0.5))
  assert (cfg.warmup_steps, cfg.max_norm, cfg.weight_decay) == (10, 0.5, 0.0)


# --- Training -----------------------------------------------------------------------


def test_a_few_steps_lower_the_loss(v2_run):
  _, records = v2_run
  losses = [r["loss"] for r in steps_of(records)]
  assert len(losses) == 20
  assert losses[0] == pytest.approx(np.log(512), abs=0.3)  # about uniform at the start
  # About 0.5 nats lower after 20 steps; the exact figure moves with the last bit of the
  # clip's norm (8 of the 20 steps clip) and with the default corpus, so the bound is 0.3.
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3


def test_every_step_record_has_the_promised_metrics(v2_run):
  cfg, records = v2_run
  for r in steps_of(records):
    assert set(r) == {"kind", "step", "phase", "loss", "loss_by_source", "grad_norm",
                      "clipped", "spike", "norm_mean", "top_leaves", "skipped_count", "lr",
                      "tokens_per_s", "step_time_s", "device_memory_bytes"}
    assert (r["spike"], r["norm_mean"], r["top_leaves"], r["skipped_count"]) == (
        False, 0.0, None, 0)  # --spike off
    assert set(r["loss_by_source"]) == set(NAMES)
    assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    assert len(r["device_memory_bytes"]) == jax.device_count()
    assert min(r["device_memory_bytes"]) > 0
    assert r["clipped"] == (r["grad_norm"] > cfg.max_norm)
  assert steps_of(records)[0]["lr"] == pytest.approx(3e-3 / 3)
  with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
    assert [json.loads(line) for line in f] == records


def test_phases_are_logged_with_weights_and_reward(v2_run):
  cfg, records = v2_run
  phases = [r for r in records if r["kind"] == "phase"]
  assert [p["step"] for p in phases] == bandit.phase_starts(cfg.seed, cfg.steps)
  assert phases[0]["reward"] is None
  for p in phases:
    assert sum(p["weights"].values()) == pytest.approx(1.0)
    assert min(p["weights"].values()) > 0
  for p in phases[1:]:
    assert set(p["reward"]) == set(NAMES)
  steps = steps_of(records)
  for p, next_p in zip(phases, phases[1:] + [{"step": cfg.steps + 1}]):
    assert {r["phase"] for r in steps if p["step"] <= r["step"] < next_p["step"]} == {
        p["phase"]}


def test_the_run_writes_its_report(v2_run):
  cfg, _ = v2_run
  files = set(os.listdir(cfg.out_dir))
  assert {"metrics.jsonl", "config.json", "report.png", "samples.txt", "summary.json",
          "checkpoints"} <= files
  with open(os.path.join(cfg.out_dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["final_loss"] < summary["initial_loss"]
  assert len(summary["samples"]) == 2
  assert set(summary["repetition"]) == {"distinct_2", "repeat_4", "top_token_share"}


def test_samples_continue_prompts_cut_from_the_held_out_text(v2_run):
  cfg, _ = v2_run
  texts = corpus.load_corpus({}, int(cfg.max_source_mb * 2**20))
  held_out = {name: corpus.split_held_out(docs)[1] for name, docs in texts.items()}
  expected = corpus.held_out_prompts(held_out, 2)
  with open(os.path.join(cfg.out_dir, "summary.json")) as f:
    samples = json.load(f)["samples"]
  # A prompt keeps its first context_length // 2 = 16 tokens.
  assert [s["prompt"] for s in samples] == [p[:len(s["prompt"])] for p, s in zip(expected, samples)]
  assert all(len(s["prompt"]) >= 16 for s in samples)  # a byte-level token is >= 1 char


def test_prompts_given_on_the_command_line_and_status_lines(tmp_path, capsys):
  argv = ["--config", "tiny", "--steps", "2", "--batch-size", "4", "--context-length", "32",
          "--vocab-size", "300", "--max-source-mb", "0.02", "--no-plot", "--no-progress",
          "--sample-tokens", "4", "--out-dir", str(tmp_path / "run"),
          "--cache-dir", str(tmp_path / "cache"), "--prompt", "Once upon a time",
          "--prompt", "Question: Why clip?"]
  train_gpt.main(argv)
  with open(tmp_path / "run" / "summary.json") as f:
    samples = json.load(f)["samples"]
  assert [s["prompt"] for s in samples] == ["Once upon a time", "Question: Why clip?"]
  out = capsys.readouterr().out
  for step in ("reading the sources", "training the BPE tokenizer (vocabulary 300) on",
               "tokenizing the sources", "compiling the training step"):
    assert re.search(f"^{re.escape(step)}.* \\.\\.\\.$", out, re.M), step
    assert re.search(f"^{re.escape(step)}.*: \\d+\\.\\d s$", out, re.M), step
  train_gpt.main(argv + ["--overwrite"])  # the tokenizer is cached now: no line for it
  assert "training the BPE tokenizer" not in capsys.readouterr().out


def test_spike_skip_runs_and_logs_its_statistics(tmp_path, tiny):
  """--spike skip: every step logs the norm's running mean; a spike step, and only one,
  names its largest leaves and is skipped; the summary lists the spikes."""
  cfg = tiny(tmp_path, steps=40, spike="skip", plot=True)
  steps = steps_of(loop.train(cfg))
  assert all(r["norm_mean"] > 0 for r in steps)
  assert all(not r["spike"] for r in steps[:25])  # ZScoreSpike's warmup
  spikes = [r["step"] for r in steps if r["spike"]]
  assert [r["step"] for r in steps if r["top_leaves"] is not None] == spikes
  assert steps[-1]["skipped_count"] == len(spikes)
  with open(os.path.join(cfg.out_dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["spike_steps"] == spikes and summary["skipped_steps"] == len(spikes)
  assert os.path.exists(os.path.join(cfg.out_dir, "report.png"))


def test_a_spike_record_names_the_five_largest_leaves():
  leaf_norms = np.array([0.5, 4.0, 0.1, 3.0, 2.0, 9.0, 1.0], np.float32)
  names = [f"w{i}" for i in range(7)]
  m = {"loss": 3.0, "grad_norm": 11.0, "clipped": True, "spike": True, "norm_mean": 2.5,
       "leaf_norms": leaf_norms, "skipped_count": 1, "lr": 1e-3,
       "loss_sum_K": np.ones(3), "rows_K": np.ones(3)}
  r = metrics.step_record(7, 0, ["a", "b", "c"], m, 1.0, 0.1, [1], names)
  assert r["top_leaves"] == [["w5", 9.0], ["w1", 4.0], ["w3", 3.0], ["w4", 2.0],
                             ["w6", 1.0]]
  assert metrics.step_record(8, 0, ["a", "b", "c"], dict(m, spike=False), 1.0, 0.1, [1],
                             names)["top_leaves"] is None


def test_v1_logs_the_norm_it_does_not_clip(v2_run, tmp_path):
  v2_cfg, v2_records = v2_run
  records = loop.train(dataclasses.replace(
      v2_cfg, recipe="v1", max_norm=None, weight_decay=None, warmup_steps=None, steps=2,
      out_dir=str(tmp_path), plot=False, num_samples=0))
  first = steps_of(records)[0]
  assert first["clipped"] is False
  # Same weights and batch at step 1: the norm read from the clip state (v2) and the one
  # computed by clipjax.global_norm (v1) are one number.
  assert first["grad_norm"] == pytest.approx(steps_of(v2_records)[0]["grad_norm"], rel=1e-5)


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, tiny):
  require_repeatable_bits()
  # A seed whose first phase ends at step 7, so the stop at step 5 falls mid-phase and
  # the resumed run crosses a boundary whose reward includes steps before the stop.
  seed = next(s for s in range(100) if bandit.phase_starts(s, 14)[1:2] == [8])
  whole = loop.train(tiny(tmp_path / "whole", steps=14, seed=seed))
  split_cfg = tiny(tmp_path / "split", steps=14, seed=seed)
  loop.train(dataclasses.replace(split_cfg, stop_after_step=5))
  resumed = loop.train(dataclasses.replace(split_cfg, resume=True))
  assert len(steps_of(resumed)) == 14
  for a, b in zip(whole, resumed):
    a, b = dict(a), dict(b)
    for measured in metrics.MEASURED:
      a.pop(measured, None), b.pop(measured, None)
    assert a == b


def test_time_limit_ends_the_run_with_its_report(tmp_path, tiny):
  # A limit that has passed before step 1 ends: one step, then samples and summary.
  cfg = tiny(tmp_path, steps=20, time_limit_s=1e-9, num_samples=1, sample_tokens=4,
             plot=True)
  records = loop.train(cfg)
  assert [r["step"] for r in steps_of(records)] == [1]
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == 1 and summary["planned_steps"] == 20
  assert summary["stopped_by_time_limit"] is True and len(summary["samples"]) == 1
  assert (tmp_path / "report.png").stat().st_size > 0
  # The run stopped after a checkpoint: --resume continues it to the planned end.
  resumed = loop.train(dataclasses.replace(cfg, time_limit_s=None, resume=True))
  assert len(steps_of(resumed)) == 20


def test_resume_with_other_settings_is_refused(tmp_path, tiny):
  cfg = tiny(tmp_path, steps=4)
  loop.train(dataclasses.replace(cfg, stop_after_step=2))
  with pytest.raises(config.ConfigError, match=r"--resume: .*peak_lr=0.003 \(now 0.001\)"):
    loop.train(dataclasses.replace(cfg, resume=True, peak_lr=1e-3))


# --- Bad flags and sources ----------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--recipe", "v3"], "argument --recipe: invalid choice: 'v3'"),
    (["--clip-impl", "cuda"], "argument --clip-impl: invalid choice: 'cuda'"),
    (["--clip-mode", "local"], "argument --clip-mode: invalid choice: 'local'"),
    (["--spike", "on"], "argument --spike: invalid choice: 'on'"),
    (["--recipe", "v1", "--spike", "skip"], "--spike skip works through the clip: it needs "
     "--max-norm > 0"),
    (["--steps", "0"], "--steps must be > 0, got 0"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--batch-size", "-4"], "--batch-size must be > 0, got -4"),
    (["--steps", "10", "--stop-after-step", "11"], r"--stop-after-step must be in \[1, 10\]"),
    (["--time-limit-s", "0"], "--time-limit-s must be > 0, got 0"),
    (["--bandit-floor", "0.5"], r"--bandit-floor: bandit floor must be in \(0, 1/3\)"),
    (["--source", "wiki=x.txt"], "unknown source 'wiki'"),
    (["--source", "gutenberg=/no/such/dir/*.txt"],
     "source 'gutenberg': no file matches '/no/such/dir/\\*.txt'"),
])
def test_bad_flags_exit_with_a_clear_error(argv, message, capsys, tmp_path):
  with pytest.raises(SystemExit) as exit_info:
    train_gpt.main(argv + ["--out-dir", str(tmp_path), "--cache-dir", str(tmp_path)])
  assert exit_info.value.code == 2
  assert re.search(message, capsys.readouterr().err)


def test_an_empty_source_file_is_named(capsys, tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(SystemExit):
    train_gpt.main(["--source", f"hermes3-general={empty}", "--out-dir", str(tmp_path),
                    "--cache-dir", str(tmp_path)])
  assert (f"source 'hermes3-general': no usable text in '{empty}'; skipped {empty} (no text)"
          in capsys.readouterr().err)


def test_a_source_shorter_than_the_context_is_named(tmp_path, tiny):
  short = tmp_path / "short.txt"
  short.write_text("Too short to fill a context window of 32 tokens.")
  with pytest.raises(ValueError, match="source 'gutenberg' has .* tokens of training text; "
                     "a batch row needs --context-length"):
    loop.train(tiny(tmp_path / "run", cache_dir=str(tmp_path / "cache"),
                    sources=(f"gutenberg={short}",)))


def test_a_run_gets_the_jitted_step_of_an_earlier_run_with_the_same_settings(tmp_path, tiny):
  """Within a process, a run that differs from an earlier one only where the step does not
  look (its directory, seed, time limit, resume) reuses its jitted step; any setting the
  step is built from makes a new one."""
  cfg = config.resolve(config.check(tiny(tmp_path / "a")))
  graphdef, _ = loop.init_model(cfg)
  step = train_step.train_step_for(graphdef, cfg, 3)
  again = dataclasses.replace(cfg, out_dir=str(tmp_path / "b"), seed=7, time_limit_s=5.0,
                              resume=True, stop_after_step=2, num_samples=0)
  assert train_step.train_step_for(graphdef, again, 3) is step
  assert train_step.train_step_for(graphdef, cfg, 4) is not step
  for field, value in (("steps", cfg.steps + 1), ("peak_lr", cfg.peak_lr / 2),
                       ("max_norm", 0.5), ("spike", "zscore"), ("clip_impl", "ffi"),
                       ("batch_size", 2 * cfg.batch_size),
                       ("dtype", {"float32": "bfloat16", "bfloat16": "float32"}[cfg.dtype])):
    other = dataclasses.replace(cfg, **{field: value})
    assert train_step.train_step_for(graphdef, other, 3) is not step, field
  assert set(train_step.OUTSIDE_THE_STEP) < {f.name for f in dataclasses.fields(cfg)}
