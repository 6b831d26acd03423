"""Phases and the EXP3-style bandit that sets the source weights at every phase boundary.

Phases. Training is cut into phases of 7, 14, 21, 28 or 42 steps, each length drawn at
random from a generator seeded by the run's seed alone, so the boundaries are a pure
function of the seed (and the same for any number of training steps). During a phase
every batch row is drawn from source i with probability w_i (pipeline.py).

Reward. Over a phase of N rows, source i supplied n_i rows whose losses sum to S_i. Its
reward is its share of the phase's loss, importance-weighted by its probability:

    r_i = (S_i / N) / w_i

Since E[n_i] = N * w_i, r_i is an unbiased estimate of the mean training loss on source
i (EXP3's importance weighting; a source not drawn at all gets 0). Loss is the reward,
as in online data mixing (Albalak et al., 2023): a source the model still predicts
badly has the most left to teach it.

Update. The rewards are smoothed across phases (the first phase's reward is taken as
is), then turned into weights by a softmax mixed with a uniform exploration floor:

    R_i <- a * R_i + (1 - a) * r_i                 a = smoothing
    w_i  = (1 - K * floor) * softmax(eta * R)_i + floor

so every weight is at least `floor` (> 0) and the weights sum to 1. eta is in 1/nats:
a source whose smoothed loss is 1 nat higher than another's gets e^eta times its weight
(before the floor). The first phase uses uniform weights.
"""

import dataclasses

import numpy as np

PHASE_LENGTHS = (7, 14, 21, 28, 42)
_PHASE_SEED_STREAM = 0x5EED_0F_9A5E  # keeps phase draws apart from the data draws


@dataclasses.dataclass(frozen=True)
class BanditConfig:
  eta: float = 2.0
  floor: float = 0.05
  smoothing: float = 0.5


def phase_starts(seed: int, num_steps: int) -> list[int]:
  """The first step (steps count from 1) of every phase that begins by num_steps."""
  rng = np.random.default_rng([seed, _PHASE_SEED_STREAM])
  starts = [1]
  while True:
    next_start = starts[-1] + int(rng.choice(PHASE_LENGTHS))
    if next_start > num_steps:
      return starts
    starts.append(next_start)


@dataclasses.dataclass
class BanditState:
  """Everything the bandit remembers; saved in every checkpoint (see to_json)."""
  weights: np.ndarray  # (K,) sampling probabilities of the current phase
  smoothed_reward: np.ndarray  # (K,) R
  num_updates: int  # phase boundaries seen so far
  phase_loss_sum: np.ndarray  # (K,) S_i, so far in the current phase
  phase_rows: np.ndarray  # (K,) n_i, so far in the current phase

  @classmethod
  def initial(cls, num_sources: int) -> "BanditState":
    zeros = np.zeros(num_sources)
    return cls(np.full(num_sources, 1.0 / num_sources), zeros, 0, zeros, zeros)

  def to_json(self) -> dict:
    # float64 -> Python float -> JSON text round-trips exactly (repr is shortest-exact).
    return {
        "weights": self.weights.tolist(),
        "smoothed_reward": self.smoothed_reward.tolist(),
        "num_updates": self.num_updates,
        "phase_loss_sum": self.phase_loss_sum.tolist(),
        "phase_rows": self.phase_rows.tolist(),
    }

  @classmethod
  def from_json(cls, d: dict) -> "BanditState":
    return cls(
        weights=np.asarray(d["weights"], np.float64),
        smoothed_reward=np.asarray(d["smoothed_reward"], np.float64),
        num_updates=int(d["num_updates"]),
        phase_loss_sum=np.asarray(d["phase_loss_sum"], np.float64),
        phase_rows=np.asarray(d["phase_rows"], np.float64))


def observe(state: BanditState, loss_sum_K, rows_K) -> BanditState:
  """Adds one step's per-source loss sums and row counts to the current phase."""
  return dataclasses.replace(
      state,
      phase_loss_sum=state.phase_loss_sum + np.asarray(loss_sum_K, np.float64),
      phase_rows=state.phase_rows + np.asarray(rows_K, np.float64))


def end_phase(state: BanditState, cfg: BanditConfig) -> tuple[BanditState, np.ndarray]:
  """The state for the next phase (new weights, counters reset) and the rewards r_i."""
  total_rows = state.phase_rows.sum()
  if total_rows == 0:
    raise ValueError("a phase ended without any observed rows")
  reward = (state.phase_loss_sum / total_rows) / state.weights
  if state.num_updates == 0:
    smoothed = reward
  else:
    smoothed = cfg.smoothing * state.smoothed_reward + (1 - cfg.smoothing) * reward
  zeros = np.zeros_like(reward)
  new_state = BanditState(
      weights=weights_from_rewards(smoothed, cfg), smoothed_reward=smoothed,
      num_updates=state.num_updates + 1, phase_loss_sum=zeros, phase_rows=zeros)
  return new_state, reward


def weights_from_rewards(smoothed_reward: np.ndarray, cfg: BanditConfig) -> np.ndarray:
  num_sources = len(smoothed_reward)
  if not 0 < cfg.floor * num_sources < 1:
    raise ValueError(f"bandit floor must be in (0, 1/{num_sources}), got {cfg.floor}")
  logits = cfg.eta * smoothed_reward
  softmax = np.exp(logits - logits.max())
  softmax /= softmax.sum()
  weights = (1 - num_sources * cfg.floor) * softmax + cfg.floor
  return weights / weights.sum()  # exact normalisation against rounding
