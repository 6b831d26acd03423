"""The training loop's numbers do not depend on how it feeds the devices (steps.py,
pipeline.py): the same losses, phase boundaries and EXP3 weights as the loop that
fetched every step's metrics at once, whatever --log-every is.

The reference figures were made by the example of commit 83c384a (the loop before
batches were put on the devices by the training thread and metrics fetched in groups) on
the synthetic corpus below, which depends on nothing installed, on a CPU, in float32. On
that machine (x86-64, jax 0.10.2) today's loop gives them bit for bit; RTOL leaves room
for another CPU's or XLA's float32 sums. On a GPU the run is held to float32 too: float32
compute, XLA's attention and float32 matmuls (a GPU's default would round their inputs
to TensorFloat-32, and "auto" would compute in bfloat16).
"""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest

from gpt.reports import metrics
from gpt.training import loop
from examples.tests.conftest import require_repeatable_bits

SEED = 16  # phases start at steps 1, 15, 29, 43 and 57 of 60: four bandit updates
PHASE_STEPS = [1, 15, 29, 43, 57]
WEIGHTS = [  # repo-docs, gutenberg, hermes3-general
    [0.3333333333, 0.3333333333, 0.3333333333],
    [0.4665945342, 0.4679218411, 0.06548362477],
    [0.4919745841, 0.4569742058, 0.05105121019],
    [0.2282551606, 0.7171956033, 0.05454923608],
    [0.1064201751, 0.8127372049, 0.08084262],
]
LOSSES = [
    6.286688, 6.121067, 6.033714, 5.815696, 5.894059, 5.717991, 5.581399, 5.587203,
    5.395912, 5.235019, 5.292466, 5.358016, 5.409605, 5.182606, 5.088939, 5.03153,
    5.050407, 4.903248, 4.737273, 4.882117, 4.726195, 4.868607, 4.529889, 4.657288,
    4.254493, 4.433978, 4.321541, 4.386437, 4.517655, 4.468328, 4.678443, 4.337239,
    4.376484, 4.365243, 4.401423, 4.408275, 4.461032, 4.169643, 4.242192, 4.21207,
    4.377027, 4.478644, 4.888268, 4.674594, 4.478848, 4.73632, 4.435454, 4.630951,
    4.343889, 4.69665, 4.351853, 4.362269, 4.504327, 4.625462, 4.570192, 4.506617,
    4.754326, 4.528723, 4.391991, 4.58245,
]
# float32 sums in another order (another CPU, another XLA) move the last bits, and 60
# steps at lr 1e-3 with the clip at work in 50 of them keep such changes below 1e-5.
RTOL = 1e-4
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "po", "da", "fu")


def write_sources(directory) -> tuple[str, ...]:
  """Three sources of made-up words (markdown lists, prose, question-answer JSONL), the
  same on every machine; their --source flags."""
  rng = np.random.default_rng(20261201)
  words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(300)]
  sentence = lambda n: " ".join(rng.choice(words, size=n)).capitalize() + "."
  directory.mkdir(parents=True, exist_ok=True)
  docs, prose, qa = directory / "docs.md", directory / "prose.txt", directory / "qa.jsonl"
  docs.write_text("".join(
      f"# Section {i}\n\n" + "".join(f"- {sentence(6)}\n" for _ in range(5)) + "\n"
      for i in range(120)))
  prose.write_text("\n\n".join(" ".join(sentence(12) for _ in range(6)) for _ in range(60)))
  qa.write_text("".join(
      json.dumps({"question": sentence(5)[:-1] + "?", "answer": sentence(9)}) + "\n"
      for _ in range(400)))
  return (f"repo-docs={docs}", f"gutenberg={prose}", f"hermes3-general={qa}")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, tiny):
  directory = tmp_path_factory.mktemp("loop")
  return tiny(directory / "run", steps=60, peak_lr=1e-3, warmup_steps=5, seed=SEED,
              max_source_mb=1, sources=write_sources(directory / "sources"),
              dtype="float32", attention="xla",
              cache_dir=str(directory / "cache"))


def train_in_float32(cfg):
  """loop.train(cfg) with float32 matmuls on every platform. A global setting, not the
  thread-local context manager: the loop may trace its step on a thread of its own."""
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", "float32")
  try:
    return loop.train(cfg)
  finally:
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def records(cfg):
  return train_in_float32(cfg)


def _unmeasured(records):
  return [{k: v for k, v in r.items() if k not in metrics.MEASURED} for r in records]


def test_the_bandit_and_the_losses_are_those_of_the_loop_before(records):
  phases = [r for r in records if r["kind"] == "phase"]
  assert [p["step"] for p in phases] == PHASE_STEPS
  np.testing.assert_allclose([list(p["weights"].values()) for p in phases], WEIGHTS,
                             rtol=RTOL)
  np.testing.assert_allclose([r["loss"] for r in metrics.step_records(records)], LOSSES,
                             rtol=RTOL)


@pytest.mark.slow
def test_the_metrics_fetched_in_groups_are_those_fetched_step_by_step(cfg, records, tmp_path):
  """--log-every 10 (the default) against 1: every record the same, bit for bit, but what
  measures the machine (metrics.MEASURED); the bandit saw the same losses in the same order."""
  require_repeatable_bits()
  assert cfg.log_every == 10
  each_step = train_in_float32(dataclasses.replace(cfg, out_dir=str(tmp_path), log_every=1))
  assert _unmeasured(each_step) == _unmeasured(records)


def test_a_group_shares_its_mean_step_time(records):
  """The steps fetched together (10, or fewer before a phase boundary or a checkpoint)
  are given the group's mean time; there are about steps / 10 + boundaries groups."""
  times = [r["step_time_s"] for r in metrics.step_records(records)]
  assert all(t > 0 for t in times)
  groups = [len(list(g)) for _, g in itertools.groupby(times)]
  assert max(groups) <= 10 and sum(groups) == 60
  assert len(groups) <= 60 // 10 + len(PHASE_STEPS) + 1
