"""The example's training program (examples/train_gpt.py, config.py), on tiny settings."""

import dataclasses
import json
import os
import pathlib
import re
import sys

import clipjax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import bandit  # noqa: E402
import config  # noqa: E402
import train_gpt  # noqa: E402

NAMES = ("repo-docs", "gutenberg", "hermes3-general")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tokenizer-cache"))


def tiny(out_dir, cache_dir, **overrides) -> config.TrainConfig:
  """The tiny model on a small vocabulary, short context and few steps."""
  settings = dict(
      config="tiny", steps=20, batch_size=8, context_length=32, vocab_size=512,
      peak_lr=3e-3, warmup_steps=3, max_source_mb=0.05, checkpoint_every=1000,
      out_dir=str(out_dir), cache_dir=cache_dir, num_samples=0, plot=False,
      progress=False)
  return config.TrainConfig(**{**settings, **overrides})


def steps_of(records):
  return [r for r in records if r["kind"] == "step"]


@pytest.fixture(scope="module")
def v2_run(tmp_path_factory, cache_dir):
  cfg = tiny(tmp_path_factory.mktemp("v2"), cache_dir, plot=True, num_samples=2,
             sample_tokens=8)
  return config.resolve(cfg), train_gpt.train(cfg)


# --- Settings -----------------------------------------------------------------------


def test_andrea_presets_follow_the_documents():
  cfg = config.resolve(config.TrainConfig(config="andrea-120m"))
  assert (cfg.peak_lr, cfg.warmup_steps, cfg.max_norm, cfg.weight_decay) == (
      3e-4, 2000, 1.0, 0.1)
  schedule = train_gpt.lr_schedule(cfg)
  assert float(schedule(0)) == pytest.approx(1.5e-7)  # step 1
  assert float(schedule(1999)) == pytest.approx(3e-4)  # step 2000: the peak
  assert float(schedule(cfg.steps - 1)) == pytest.approx(3e-5)  # the end: peak * 0.1


def test_v1_recipe_is_no_clip_adam_no_warmup():
  cfg = config.resolve(config.TrainConfig(config="andrea-120m", recipe="v1"))
  assert (cfg.max_norm, cfg.weight_decay, cfg.warmup_steps) == (0.0, 0.0, 0)
  assert float(train_gpt.lr_schedule(cfg)(0)) == pytest.approx(3e-4, rel=1e-6)
  with pytest.raises(ValueError, match="no AndreaClipState"):
    clipjax.clip_state(train_gpt.make_optimizer(cfg).init({"w": np.zeros(3)}))


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
                      "clipped", "lr", "tokens_per_s"}
    assert set(r["loss_by_source"]) == set(NAMES)
    assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0
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


def test_v1_logs_the_norm_it_does_not_clip(v2_run, tmp_path, cache_dir):
  v2_cfg, v2_records = v2_run
  records = train_gpt.train(dataclasses.replace(
      v2_cfg, recipe="v1", max_norm=None, weight_decay=None, warmup_steps=None, steps=2,
      out_dir=str(tmp_path), plot=False, num_samples=0))
  first = steps_of(records)[0]
  assert first["clipped"] is False
  # Same weights and batch at step 1: the norm read from the clip state (v2) and the one
  # computed by clipjax.global_norm (v1) are one number.
  assert first["grad_norm"] == pytest.approx(steps_of(v2_records)[0]["grad_norm"], rel=1e-5)


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, cache_dir):
  # A seed whose first phase ends at step 7, so the stop at step 5 falls mid-phase and
  # the resumed run crosses a boundary whose reward includes steps before the stop.
  seed = next(s for s in range(100) if bandit.phase_starts(s, 14)[1:2] == [8])
  whole = train_gpt.train(tiny(tmp_path / "whole", cache_dir, steps=14, seed=seed))
  split_cfg = tiny(tmp_path / "split", cache_dir, steps=14, seed=seed)
  train_gpt.train(dataclasses.replace(split_cfg, stop_after_step=5))
  resumed = train_gpt.train(dataclasses.replace(split_cfg, resume=True))
  assert len(steps_of(resumed)) == 14
  for a, b in zip(whole, resumed):
    a, b = dict(a), dict(b)
    a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)
    assert a == b


def test_time_limit_ends_the_run_with_its_report(tmp_path, cache_dir):
  # A limit that has passed before step 1 ends: one step, then samples and summary.
  cfg = tiny(tmp_path, cache_dir, steps=20, time_limit_s=1e-9, num_samples=1, sample_tokens=4,
             plot=True)
  records = train_gpt.train(cfg)
  assert [r["step"] for r in steps_of(records)] == [1]
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == 1 and summary["planned_steps"] == 20
  assert summary["stopped_by_time_limit"] is True and len(summary["samples"]) == 1
  assert (tmp_path / "report.png").stat().st_size > 0
  # The run stopped after a checkpoint: --resume continues it to the planned end.
  resumed = train_gpt.train(dataclasses.replace(cfg, time_limit_s=None, resume=True))
  assert len(steps_of(resumed)) == 20


def test_resume_with_other_settings_is_refused(tmp_path, cache_dir):
  cfg = tiny(tmp_path, cache_dir, steps=4)
  train_gpt.train(dataclasses.replace(cfg, stop_after_step=2))
  with pytest.raises(config.ConfigError, match=r"--resume: .*peak_lr=0.003 \(now 0.001\)"):
    train_gpt.train(dataclasses.replace(cfg, resume=True, peak_lr=1e-3))


# --- Bad flags and sources ----------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--recipe", "v3"], "argument --recipe: invalid choice: 'v3'"),
    (["--clip-impl", "cuda"], "argument --clip-impl: invalid choice: 'cuda'"),
    (["--clip-mode", "local"], "argument --clip-mode: invalid choice: 'local'"),
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
  assert f"source 'hermes3-general': file {empty} is empty" in capsys.readouterr().err


def test_a_source_shorter_than_the_context_is_named(tmp_path, cache_dir):
  short = tmp_path / "short.txt"
  short.write_text("Too short to fill a context window of 32 tokens.")
  with pytest.raises(ValueError, match="source 'gutenberg' has .* tokens; a batch row"):
    train_gpt.train(tiny(tmp_path, str(tmp_path / "cache"), sources=(f"gutenberg={short}",)))
