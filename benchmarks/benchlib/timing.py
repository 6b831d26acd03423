"""Timed rounds of jitted calls, and the max_norm schedule that keeps every clip of a round
in its regime.

A round makes a fixed number of calls, each holding a fixed amount of work (K clips or one
optimizer step), and the clock stops once the last call's outputs are ready: the time per
call is the round's over the calls. One more round under the profiler gives the devices'
busy time per call (profiling.device_seconds), which is the number to read whenever the
host's dispatch of a call takes longer than the device's work.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import jax
import jax.numpy as jnp

from benchlib import profiling
from benchlib.trees import F32, f32_norm

REGIMES = ("clip", "noclip")
NORM_RATIO = 10.0  # ||g|| / max_norm is 10 at the start of the clipping regime, 1/10 otherwise
# Clipping, max_norm falls by this factor each time round the trees, so every repetition
# clips, with a margin above bf16's rounding (one ulp is up to 0.8%) and optax's bf16 norm
# (3% off).
DECAY = 0.97
# A round clips each tree at most this many times (a clipping round of a large K makes
# fewer calls), so max_norm stays far inside float32's range: 0.97^600 is 1e-8.
MAX_CLIPS_PER_TREE = 600
WARMUP_CALLS = 2
PROFILED_CALLS = 3
PER_CALL_FACTOR = 2  # a round of one clip per call makes this many times --iters calls
COPY_BYTES = 1 << 30


def max_norm_at(regime, norm0, rep, rotation=1):
  """max_norm of repetition `rep` (0, 1, ...) of a round that starts from norm `norm0`,
  where repetition k clips tree k % rotation.

  Clipping: norm0 / 10, then 3% lower each time round the trees, so a tree clipped before
  (its norm is now that max_norm) is clipped again. Not clipping: 10 * norm0.
  """
  if regime == "clip":
    return norm0 / NORM_RATIO * DECAY**(rep // rotation)
  return norm0 * NORM_RATIO


def max_norm_schedule(regime, norm0, n, first=0, rotation=1):
  """max_norm for repetitions first ... first + n - 1, as device scalars made before the
  clock starts. They are weakly typed, as a literal max_norm is, so optax keeps bf16 trees
  in bf16."""
  return [jnp.asarray(max_norm_at(regime, norm0, first + j, rotation)) for j in range(n)]


def regime_holds(regime, trees, norm0, reps_done, rotation=1):
  """After a round: would the next repetition still clip (or still not clip)?"""
  norms = [float(f32_norm(t)) for t in trees]
  next_max = max_norm_at(regime, norm0, reps_done, rotation)
  if not all(math.isfinite(n) for n in norms):
    return False
  return all((n > next_max) if regime == "clip" else (n <= next_max) for n in norms)


def spread(values):
  """The median, lowest and highest of a clock's per-round values, and the values."""
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "rounds": values}


def median_interval(values, confidence=0.95):
  """(low, high, coverage): an interval that holds the median of the values' population
  with probability `coverage` >= `confidence`, taking the rounds as independent draws (a
  paired ratio's rounds, whose shared drift cancels): the k-th lowest and k-th highest
  values, k the largest with 2 P(Binomial(n, 1/2) < k) <= 1 - confidence. No assumption on
  the distribution's shape. None for too few values (below 6 for 95%)."""
  n = len(values)
  tail, k = 0.0, 0  # tail: P(Binomial(n, 1/2) < k + 1)
  while k < n:
    step = math.comb(n, k) / 2.0**n
    if 2 * (tail + step) > 1 - confidence:
      break
    tail, k = tail + step, k + 1
  if k == 0:
    return None
  ordered = sorted(values)
  return ordered[k - 1], ordered[n - k], 1 - 2 * tail


def verdict(interval, bound):
  """Whether a ratio whose median lies in `interval` (`median_interval`) is at most `bound`:
  "met" where the whole interval is, "not met" where none of it is, else "cannot tell"."""
  if interval is None:
    return "too few rounds"
  low, high, _ = interval
  return "met" if high <= bound else "not met" if low > bound else "cannot tell"


def interleaved_rounds(items, rounds, measure):
  """{item: [measure(item) in each round]}: every round measures each item once, in an order
  that rotates by one item a round (so that drift hits each alike), with Python's garbage
  collector off (and a collection before)."""
  items = list(items)
  out = {item: [] for item in items}
  for r in range(rounds):
    gc.collect()
    gc.disable()
    try:
      for item in items[r % len(items):] + items[:r % len(items)]:
        out[item].append(measure(item))
    finally:
      gc.enable()
  return out


def timed_steps(sync, step, steps, drained=False):
  """(wall seconds, [seconds inside each call]) of `steps` calls of `step()`: wall from the
  first call until `sync()` (which waits for the device) returns after the last. `drained`:
  `sync()` before every call too, so that each finds the device idle and nothing queued."""
  sync()
  inside = []
  t0 = time.perf_counter()
  for _ in range(steps):
    if drained:
      sync()
    t = time.perf_counter()
    step()
    inside.append(time.perf_counter() - t)
  sync()
  return time.perf_counter() - t0, inside


def seconds_per_call(fresh, call, calls, repeats, profile=True):
  """Times `repeats` rounds of `calls` calls after a warm-up round, then, if `profile` and
  the backend is not the CPU, one round of PROFILED_CALLS calls under the profiler.

  `fresh(state)` prepares a round outside the clock (fresh data, its max_norm schedule);
  `call(state, c)` makes call number c and returns the new state, whose "arrays" the clock
  waits for. Returns a dict: `s` (median wall seconds per call), `samples`,
  `enqueue_fraction` (the share of a round the host spent issuing calls: near 1, the host,
  not the device, set the pace), `device_s` (the busiest device's busy seconds per call, or
  None), `device_s_per_device`, `kernels_s`, the final `state` and `calls_since_fresh`.
  """
  state, samples, enqueue = None, [], []
  for r in range(repeats + 1):
    state = fresh(state)
    jax.block_until_ready(state["arrays"])
    n = WARMUP_CALLS if r == 0 else calls
    t0 = time.perf_counter()
    for c in range(n):
      state = call(state, c)
    t1 = time.perf_counter()
    jax.block_until_ready(state["arrays"])
    if r:
      samples.append((time.perf_counter() - t0) / n)
      enqueue.append((t1 - t0) / n / samples[-1])
  out = {"s": statistics.median(samples), "samples": samples,
         "enqueue_fraction": statistics.median(enqueue), "device_s": None,
         "device_s_per_device": None, "kernels_s": {}}
  if profile and jax.default_backend() != "cpu":
    state = fresh(state)
    jax.block_until_ready(state["arrays"])
    holder = {"state": state}

    def profiled():
      for c in range(PROFILED_CALLS):
        holder["state"] = call(holder["state"], c)
      jax.block_until_ready(holder["state"]["arrays"])
    busy, kernels = profiling.device_seconds(profiled)
    state, n = holder["state"], PROFILED_CALLS
    if busy:
      out["device_s_per_device"] = {k: v / n for k, v in busy.items()}
      out["device_s"] = max(out["device_s_per_device"].values())
    out["kernels_s"] = {k: v / n for k, v in kernels.items()}
  out["state"], out["calls_since_fresh"] = state, n
  return out


def per_repetition(timing, per_call, key):
  """A timing as microseconds per repetition (a call holds `per_call`): us_<key>,
  samples_<key>_us, enqueue_fraction_<key>, and, from a profiled round, us_device,
  device_us_per_device and kernels_us."""
  out = {f"us_{key}": timing["s"] / per_call * 1e6,
         f"samples_{key}_us": [t / per_call * 1e6 for t in timing["samples"]],
         f"enqueue_fraction_{key}": timing["enqueue_fraction"]}
  if timing["device_s"] is not None:
    out["us_device"] = timing["device_s"] / per_call * 1e6
    out["device_us_per_device"] = {k: v / per_call * 1e6
                                   for k, v in timing["device_s_per_device"].items()}
  if timing["kernels_s"]:
    out["kernels_us"] = {k: v / per_call * 1e6 for k, v in timing["kernels_s"].items()}
  return out


def copy_bandwidth(n_bytes, calls, repeats):
  """Bytes read + written per second by an in-place scale of one large f32 array on the
  default device."""
  scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
  s = jnp.asarray(1.0)

  def fresh(state):
    return state or {"arrays": jnp.ones((n_bytes // 4,), F32)}

  timing = seconds_per_call(fresh, lambda st, c: {"arrays": scale(st["arrays"], s)}, calls,
                            repeats, profile=False)
  return 2 * (n_bytes // 4) * 4 / timing["s"]
