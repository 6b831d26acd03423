"""The example survives kills and corrupt checkpoints, and stops on NaN.

Each case ends in the same losses as a run that was never interrupted, or in one clear
message: a kill while a resume rewrites metrics.jsonl, a line cut by a kill mid-append,
a checkpoint with flipped bytes, a truncated data file, an empty manifest or a cut host
JSON, and a loss that turns NaN.
"""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.reports import metrics
from gpt.training import checkpoint, loop
import train_gpt
from gpt.training import train_step

steps_of = metrics.step_records

STEPS, STOP = 10, 6  # checkpoints every 2 steps: the last two kept are 4 and 6



@pytest.fixture(scope="module")
def cfg_in(tiny):
  """cfg_in(out_dir): the run these tests interrupt, damage and resume."""
  return lambda out_dir: tiny(out_dir, steps=STEPS, checkpoint_every=2, seed=3)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, cfg_in):
  """The losses of the run never interrupted."""
  return _losses(loop.train(cfg_in(tmp_path_factory.mktemp("whole"))))


def _losses(records):
  return [(r["step"], r["loss"]) for r in steps_of(records)]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, cfg_in):
  """A run stopped after step STOP, trained once; each test damages its own copy."""
  out_dir = tmp_path_factory.mktemp("stopped")
  loop.train(dataclasses.replace(cfg_in(out_dir), stop_after_step=STOP))
  return out_dir


@pytest.fixture
def resume(tmp_path, cfg_in, stopped_run):
  """The stopped run copied into tmp_path, and the config that resumes it there."""
  shutil.copytree(stopped_run, tmp_path, dirs_exist_ok=True)
  return dataclasses.replace(cfg_in(tmp_path), resume=True)


def _largest_file(step_dir):
  files = [p for p in pathlib.Path(step_dir).rglob("*")
           if p.is_file() and p.name != checkpoint.CHECKSUMS]
  return max(files, key=lambda p: p.stat().st_size)


def test_checkpoints_keep_the_last_two_with_checksums(tmp_path, resume):
  ckpts = checkpoint.RunCheckpoints(str(tmp_path / "checkpoints"), fresh=False)
  assert ckpts.steps() == [4, 6]
  for step in (4, 6):
    with open(os.path.join(ckpts.step_dir(step), checkpoint.CHECKSUMS)) as f:
      assert len(json.load(f)) >= 2
  ckpts.close()


def test_a_kill_while_a_resume_rewrites_the_metrics_leaves_the_old_file(
    tmp_path, resume, whole, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  before = path.read_bytes()

  def killed(src, dst):
    raise KeyboardInterrupt  # the process dies before the new file is in place

  with monkeypatch.context() as m:
    m.setattr(metrics.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
      loop.train(resume)
  assert path.read_bytes() == before
  assert _losses(loop.train(resume)) == whole


def test_a_line_cut_by_a_kill_mid_append_is_dropped(tmp_path, resume, whole):
  with open(tmp_path / "metrics.jsonl", "a") as f:  # a step past the checkpoint, then a cut
    f.write(json.dumps({"kind": "step", "step": STOP + 1, "loss": 0.0}) + "\n")
    f.write('{"kind": "step", "st')
  assert _losses(loop.train(resume)) == whole


def test_lost_history_is_reported_not_hidden(tmp_path, resume, capsys):
  (tmp_path / "metrics.jsonl").unlink()
  records = loop.train(resume)
  assert f"lacks the records of {STOP} of the {STOP} steps" in capsys.readouterr().out
  assert len(steps_of(records)) == STEPS - STOP
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["missing_step_records"] == STOP


def _flip_bytes(path):
  data = bytearray(path.read_bytes())
  for i in range(64):
    data[(len(data) // 2 + i) % len(data)] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(path):
  path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def _empty_manifest(step_dir):
  manifests = [p for p in pathlib.Path(step_dir).rglob("*manifest*") if p.is_file()]
  assert manifests, "no manifest in the checkpoint"
  manifests[0].write_bytes(b"")


def _cut_host_json(step_dir):
  host = [p for p in (pathlib.Path(step_dir) / "host").rglob("*") if p.is_file()]
  assert host, "no host JSON in the checkpoint"
  _truncate(host[0])


CORRUPTIONS = {
    "flipped_bytes": lambda d: _flip_bytes(_largest_file(d)),
    "truncated_data": lambda d: _truncate(_largest_file(d)),
    "empty_manifest": _empty_manifest,
    "cut_host_json": _cut_host_json,
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_named_and_the_previous_one_used(
    tmp_path, resume, whole, capsys, corruption):
  latest = tmp_path / "checkpoints" / str(STOP)
  CORRUPTIONS[corruption](latest)
  records = loop.train(resume)
  out = capsys.readouterr().out
  assert f"checkpoint {latest} is unusable" in out
  assert out.count("is unusable") == 1
  assert _losses(records) == whole  # resumed from step 4, the same losses


def test_no_usable_checkpoint_is_one_clear_error(tmp_path, resume, capsys):
  for step in (4, STOP):
    _flip_bytes(_largest_file(tmp_path / "checkpoints" / str(step)))
  argv = ["--config", "tiny", "--steps", str(STEPS), "--batch-size", "8",
          "--context-length", "32", "--vocab-size", "512", "--max-source-mb", "0.05",
          "--peak-lr", "3e-3", "--warmup-steps", "3", "--checkpoint-every", "2",
          "--seed", "3", "--out-dir", str(tmp_path), "--cache-dir", resume.cache_dir,
          "--resume", "--no-plot", "--no-progress", "--num-samples", "0"]
  with pytest.raises(SystemExit) as e:
    train_gpt.main(argv)
  assert e.value.code == 2
  assert "no usable checkpoint in" in capsys.readouterr().err


def test_a_loss_that_stays_nan_stops_the_run_and_no_nan_is_saved(
    tmp_path, cfg_in, monkeypatch):
  real = train_step.train_step_for

  def poisoned(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def step(params, opt_state, tokens, source, step):
      params, opt_state, m = step_fn(params, opt_state, tokens, source, step)
      poison = lambda x: jnp.where(step >= 5, jnp.nan, x)
      return jax.tree.map(poison, params), opt_state, {**m, "loss": poison(m["loss"])}
    return step

  monkeypatch.setattr(train_step, "train_step_for", poisoned)
  with pytest.raises(loop.TrainingDiverged, match=r"NaN/inf for 3 steps in a row "
                     r"\(steps 5-7\).*step 4 in"):
    loop.train(cfg_in(tmp_path))
  ckpts = checkpoint.RunCheckpoints(str(tmp_path / "checkpoints"), fresh=False)
  assert ckpts.steps() == [2, 4]  # step 6's would hold NaN: not saved
  ckpts.close()
  records = metrics.read_records(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in steps_of(records)] == list(range(1, 8))
  assert np.isnan(steps_of(records)[-1]["loss"])
