"""The README's main job, `train_gpt.py --config tiny` on the default corpus, ends where
the README says on any machine: within the tolerance below. (One machine gives the same
bits each time; machines differ in the last bits of float32 sums, which 300 steps carry
to the second decimal of the loss.) The whole job takes minutes, so the test is slow."""

import json

import pytest

from gpt import config
from gpt.training import loop

INITIAL_LOSS, INITIAL_TOLERANCE = 9.06, 0.01  # uniform over 8449 tokens is 9.04
FINAL_LOSS, FINAL_TOLERANCE = 4.53, 0.05  # the mean of the last 10 steps
CLIPPED_STEPS, CLIPPED_TOLERANCE = 44, 4  # of 300


@pytest.mark.slow
def test_the_main_job_ends_within_the_readmes_tolerance(tmp_path, cache_dir):
  # The README's command, less the samples and the plot, which come after the last step.
  loop.train(config.TrainConfig(config="tiny", out_dir=str(tmp_path), cache_dir=cache_dir,
                                num_samples=0, plot=False, progress=False))
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 300
  assert summary["initial_loss"] == pytest.approx(INITIAL_LOSS, abs=INITIAL_TOLERANCE)
  assert summary["final_loss"] == pytest.approx(FINAL_LOSS, abs=FINAL_TOLERANCE)
  assert abs(summary["clipped_steps"] - CLIPPED_STEPS) <= CLIPPED_TOLERANCE
