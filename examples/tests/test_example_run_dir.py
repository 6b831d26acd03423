"""The run directory: which checkpoints are kept, what one holds and how large it is, where
it is said to be, and an earlier run that is never replaced unasked."""

import json
import os
import re

import jax
import pytest

from gpt import config
from gpt.reports import metrics
from gpt.training import checkpoint, loop
import train_gpt
from gpt.training import train_step

STEPS = 6


def _state_bytes_and_leaves(cfg):
  """The bytes of the run's parameters and optimizer state, and their leaf counts."""
  _, params = loop.init_model(config.resolve(cfg))
  opt_state = train_step.make_optimizer(config.resolve(cfg)).init(params)
  leaves = {"params": jax.tree.leaves(params), "opt_state": jax.tree.leaves(opt_state)}
  return (sum(x.nbytes for x in leaves["params"] + leaves["opt_state"]),
          {k: len(v) for k, v in leaves.items()})


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny):
  """A run with a checkpoint at every step, keeping 3, and what it printed."""
  cfg = tiny(tmp_path_factory.mktemp("run"), steps=STEPS, checkpoint_every=1,
             keep_checkpoints=3)
  capture = pytest.MonkeyPatch()
  lines = []
  capture.setattr(loop.status, "say", lines.append)
  try:
    loop.train(cfg)
  finally:
    capture.undo()
  return cfg, lines


def test_only_the_last_n_checkpoints_are_kept(run):
  cfg, _ = run
  ckpts = checkpoint.RunCheckpoints(os.path.join(cfg.out_dir, "checkpoints"), fresh=False)
  assert ckpts.steps() == [4, 5, 6]
  ckpts.close()


def test_every_checkpoint_is_printed_with_its_place_and_size(run):
  cfg, lines = run
  saved = [re.fullmatch(r"step (\d+): checkpoint (\S+) \(([\d.]+) MB\)", line) for line in lines]
  saved = [m for m in saved if m]
  assert [int(m[1]) for m in saved] == list(range(1, STEPS + 1))
  last = saved[-1]
  assert last[2] == os.path.abspath(os.path.join(cfg.out_dir, "checkpoints", str(STEPS)))
  assert float(last[3]) == pytest.approx(checkpoint.directory_bytes(last[2]) / 2**20, abs=0.05)


def test_a_checkpoint_holds_the_parameters_and_optimizer_state_once(run):
  cfg, _ = run
  state_bytes, leaf_counts = _state_bytes_and_leaves(cfg)
  step_dir = os.path.join(cfg.out_dir, "checkpoints", str(STEPS))
  with open(os.path.join(step_dir, "arrays", "_METADATA")) as f:
    saved = json.load(f)["tree_metadata"].values()
  arrays = [v["key_metadata"][0]["key"] for v in saved
            if v["value_metadata"]["value_type"] != "None"]
  assert {k: arrays.count(k) for k in set(arrays)} == leaf_counts
  # Parameters, Adam's first and second moments: three float32 copies of the model, and
  # no more on disk (Orbax compresses a little; the rest is metadata).
  assert state_bytes > 3 * 4 * 0.99 * leaf_counts["params"]
  assert checkpoint.directory_bytes(step_dir) < state_bytes + 256 * 1024


def test_an_earlier_run_is_refused_without_resume_or_overwrite(run, tiny, capsys):
  cfg, _ = run
  argv = ["--config", "tiny", "--out-dir", cfg.out_dir, "--cache-dir", cfg.cache_dir]
  with pytest.raises(SystemExit) as exit_info:
    train_gpt.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.rstrip("\n").endswith(f": error: --out-dir {cfg.out_dir} holds an earlier run "
                 "(metrics.jsonl, config.json, summary.json, checkpoints): pass --resume "
                 "to continue it or --overwrite to replace it")  # one line, no traceback
  with pytest.raises(config.ConfigError, match="choose one"):
    loop.train(tiny(cfg.out_dir, resume=True, overwrite=True))


def test_overwrite_replaces_the_earlier_run(tmp_path, tiny):
  loop.train(tiny(tmp_path, steps=STEPS, checkpoint_every=2))
  records = loop.train(tiny(tmp_path, steps=STEPS, checkpoint_every=2, stop_after_step=3,
                            overwrite=True))
  assert [r["step"] for r in metrics.step_records(records)] == [1, 2, 3]
  assert not (tmp_path / "summary.json").exists()  # the earlier run's, not this one's
  ckpts = checkpoint.RunCheckpoints(str(tmp_path / "checkpoints"), fresh=False)
  assert ckpts.steps() == [2, 3]
  ckpts.close()
