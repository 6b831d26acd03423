"""Spike detection on the device: a z-score of the global norm against running statistics.

`ZScoreSpike` follows ZClip (Kumar et al., 2025, arXiv 2504.02507, and its reference
implementation) for the statistics:

- warmup: the first `warmup_steps` finite norms initialize the mean and the (population)
  variance of the norm; no step is a spike before that;
- after it, a norm above `mean + z * sqrt(var)` is a spike, and that step clips to
  `min(max_norm, mean + z * sqrt(var))` (`clip_limit`, known before the norm);
- every finite step then updates the statistics with its effective norm, the threshold on a
  spike step and the norm otherwise: `mean = d * mean + (1 - d) * x`, then
  `var = d * var + (1 - d) * (x - mean)**2` with the new mean;
- a non-finite norm never enters the statistics (nor the warmup count), so one NaN batch
  cannot blind the detector; a norm above float32's range from finite leaves is a spike
  after the warmup (and enters as the threshold), and is left out before it.

Everything here is scalar arithmetic in float32, with selects rather than conditionals.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ZScoreSpike:
  """A spike is a global norm more than `z` standard deviations above its running mean.

  Args:
    z: the threshold, in standard deviations (ZClip's default 2.5).
    decay: the running statistics' decay per step (ZClip's alpha, 0.97).
    warmup_steps: finite steps that initialize the statistics before any step can be a
      spike (25).

  Raises:
    ValueError: `z` not a number above 0, `decay` not in (0, 1), or `warmup_steps` not an
      int of at least 1.

  Examples:
    >>> import clipjax
    >>> clipjax.ZScoreSpike(z=3.0)
    ZScoreSpike(z=3.0, decay=0.97, warmup_steps=25)
    >>> clip = clipjax.andrea_clip(1.0, spike=clipjax.ZScoreSpike(warmup_steps=10))
    >>> clipjax.ZScoreSpike(decay=1.0)
    Traceback (most recent call last):
    ...
    ValueError: clipjax: ZScoreSpike decay must be in (0, 1); got 1.0
  """
  z: float = 2.5
  decay: float = 0.97
  warmup_steps: int = 25

  def __post_init__(self):
    if not (isinstance(self.z, (int, float)) and self.z > 0):
      raise ValueError(f"clipjax: ZScoreSpike z must be a number > 0; got {self.z!r}")
    if not (isinstance(self.decay, (int, float)) and 0 < self.decay < 1):
      raise ValueError(f"clipjax: ZScoreSpike decay must be in (0, 1); got {self.decay!r}")
    if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 1):
      raise ValueError("clipjax: ZScoreSpike warmup_steps must be an int >= 1; got "
                       f"{self.warmup_steps!r}")


class SpikeStats(NamedTuple):
  """The running statistics and this step's verdict (fields of `AndreaClipState`)."""
  norm_mean: jax.Array   # float32
  norm_var: jax.Array    # float32
  norm_count: jax.Array  # int32: finite steps so far (the warmup counts these)
  spike: jax.Array       # bool: this step was a spike
  spike_count: jax.Array  # int32


def initial_stats() -> SpikeStats:
  # Each field a buffer of its own: a state is donated, and no buffer may be donated twice.
  return SpikeStats(jnp.zeros((), _F32), jnp.zeros((), _F32), jnp.zeros((), jnp.int32),
                    jnp.zeros((), bool), jnp.zeros((), jnp.int32))


def _threshold(policy: ZScoreSpike, stats: SpikeStats):
  """(warm, threshold): whether the warmup is over, and the spike threshold
  mean + z * sqrt(var)."""
  return (stats.norm_count >= policy.warmup_steps,
          stats.norm_mean + policy.z * jnp.sqrt(stats.norm_var))


def clip_limit(policy: ZScoreSpike, stats: SpikeStats, max_norm):
  """The max_norm this step clips to, known before its norm: min(max_norm, threshold) once
  the warmup is over, else max_norm.

  Clipping every step to it gives each step the clip the policy asks for, in one call with
  one operand: a spike (a norm above the threshold) clips to min(max_norm, threshold); any
  other norm is at or below the threshold, so where the threshold is below max_norm both
  limits keep it, and elsewhere the limit is max_norm.
  """
  warm, threshold = _threshold(policy, stats)
  return jnp.where(warm, jnp.minimum(max_norm, threshold.astype(max_norm.dtype)), max_norm)


def step(policy: ZScoreSpike, stats: SpikeStats, norm, nonfinite) -> SpikeStats:
  """The statistics after a step whose global norm is `norm` and whose leaves were
  non-finite where `nonfinite`. A norm above float32's range (inf here, from finite leaves)
  is a spike once the warmup is over, and enters the statistics as the threshold."""
  norm = jnp.asarray(norm, _F32)
  n = stats.norm_count
  warm, threshold = _threshold(policy, stats)
  spike = ~nonfinite & warm & (norm > threshold)
  x = jnp.where(spike, threshold, norm)
  enters = jnp.isfinite(x)  # a NaN or inf norm never enters, nor counts toward the warmup
  # Warmup: the running mean and population variance of the first norms (Welford).
  count = (n + 1).astype(_F32)
  delta = x - stats.norm_mean
  warm_mean = stats.norm_mean + delta / count
  warm_var = stats.norm_var + (delta * (x - warm_mean) - stats.norm_var) / count
  # After it: the exponential moving averages.
  d = jnp.asarray(policy.decay, _F32)
  ema_mean = d * stats.norm_mean + (1 - d) * x
  ema_var = d * stats.norm_var + (1 - d) * jnp.square(x - ema_mean)
  mean = jnp.where(warm, ema_mean, warm_mean)
  var = jnp.where(warm, ema_var, warm_var)
  return SpikeStats(jnp.where(enters, mean, stats.norm_mean),
                    jnp.where(enters, var, stats.norm_var),
                    n + enters.astype(jnp.int32), spike,
                    stats.spike_count + spike.astype(jnp.int32))
