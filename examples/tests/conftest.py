"""What the example's tests share: the example's modules (and its experiments') on the
path, one tokenizer cache for the session, and the tiny settings most tests start from."""

import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES / "experiments")]

import config  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
  """One tokenizer cache for every test: each corpus trains its tokenizer once."""
  return str(tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="session")
def tiny(cache_dir):
  """tiny(out_dir, **overrides): the tiny model on a small vocabulary, short context and
  few steps, with no samples, plot or progress bar unless asked for."""

  def make(out_dir, **overrides) -> config.TrainConfig:
    settings = dict(
        config="tiny", steps=20, batch_size=8, context_length=32, vocab_size=512,
        peak_lr=3e-3, warmup_steps=3, max_source_mb=0.05, checkpoint_every=1000,
        out_dir=str(out_dir), cache_dir=cache_dir, num_samples=0, plot=False,
        progress=False)
    return config.TrainConfig(**{**settings, **overrides})

  return make
