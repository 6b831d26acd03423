"""The clips bench_clip.py times on one device, and how it times them.

The clip alone: one jitted call applies the clip K times in sequence, each repetition's
output the next one's input through an optimization barrier (so XLA can neither fuse one
repetition's scaling into the next one's norm nor drop a repetition), the trees donated (so
every repetition moves exactly one clip's bytes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

import clipjax
from benchlib import timing
from benchlib.profiling import compile_summary
from benchlib.timing import (DECAY, MAX_CLIPS_PER_TREE, NORM_RATIO, PER_CALL_FACTOR,
                             PROFILED_CALLS, WARMUP_CALLS, max_norm_schedule, regime_holds)
from benchlib.trees import f32_norm, f64_norm, max_rel_err_vs_f64

JAX_IMPLS = ("ffi", "jax", "optax")
LABELS = {"ffi": "andrea_clip", "jax": "andrea_clip(jax)", "optax": "optax", "torch": "torch"}
# Correctness against float64: one rounding of the factor and one to the leaf's type. optax
# is measured the same way and reported, not checked: on bf16 leaves it sums in bf16.
UPDATE_RTOL = {"f32": 1e-6, "bf16": 2.0**-7}
# K, the clips per in-jit call, is what moves CALL_BYTES (3N bytes per clip clipping, N not),
# at least the K given and at most MAX_REPS[impl]: enough GPU work that the host's dispatch
# of a call of hundreds of donated arrays hides behind it (bench_dispatch.py measures that
# dispatch). At most UNROLL[impl] clips are written out (compile time grows faster than that);
# a larger K runs them as passes of a loop, K = passes x written out.
CALL_BYTES = 50e9
MAX_REPS = {"ffi": 2400, "optax": 128, "jax": 48}
UNROLL = {"ffi": 80, "optax": 16, "jax": 4}


def clip_transform(impl, andrea_impl):
  """max_norm -> the clip's GradientTransformation (max_norm traced: one compile serves both
  regimes)."""
  if impl == "optax":
    return optax.clip_by_global_norm
  impl_arg = andrea_impl if impl == "ffi" else "jax"
  return lambda max_norm: clipjax.andrea_clip(max_norm, impl=impl_arg)


def repeated_clip(make_clip, loops=1, decay=1.0, name="repeated_clip"):
  """jit(trees, max_norms) -> trees: U = len(max_norms) clips written out, run `loops` times.

  Repetition k of a pass clips trees[k % len(trees)] with max_norms[k]; after each pass every
  max_norm is multiplied by `decay` (a Python float, so they stay weakly typed). With
  loops > 1 the passes are a fori_loop, so a call can hold thousands of clips while XLA
  compiles only U of them.
  """
  def one_pass(trees, max_norms):
    trees = list(trees)
    for k, m in enumerate(max_norms):
      i = k % len(trees)
      tx = make_clip(m)
      trees[i] = jax.lax.optimization_barrier(tx.update(trees[i], tx.init(trees[i]))[0])
    return trees

  def run(trees, max_norms):
    if loops == 1:
      return one_pass(trees, max_norms)

    def body(_, carry):
      trees, ms = carry
      return one_pass(trees, ms), (tuple(m * decay for m in ms) if decay != 1.0 else ms)
    return jax.lax.fori_loop(0, loops, body, (list(trees), tuple(max_norms)))[0]
  run.__name__ = name
  return jax.jit(run, donate_argnums=0)


class JaxFunctions:
  """One jitted function per clip, shared by every shape and regime."""

  def __init__(self, andrea_impl):
    self.andrea_impl = andrea_impl
    self._clips = {}

  def clip(self, impl, loops=1, decay=1.0):
    key = (impl, loops, decay)
    if key not in self._clips:
      self._clips[key] = repeated_clip(clip_transform(impl, self.andrea_impl), loops, decay)
    return self._clips[key]


def check_clips(fns, impls, case):
  """One clip per impl on the same tree, max_norm a tenth of its norm: the updates against
  the float64 product of the input and max_norm / norm."""
  reference = case.random_tree(100)
  norm = f64_norm(reference)
  checks = []
  for impl in impls:
    updates = fns.clip(impl)([case.random_tree(100)], (jnp.asarray(norm / NORM_RATIO),))
    err = max_rel_err_vs_f64(updates, reference, 1 / NORM_RATIO)
    tol = None if impl == "optax" else UPDATE_RTOL[case.dtype]
    checks.append({"model": case.model, "dtype": case.dtype, "impl": impl,
                   "what": "updates vs float64" + (" (not checked)" if tol is None else ""),
                   "value": err, "tol": tol, "ok": tol is None or err <= tol})
  return checks


def scaled_reps(K, impl, case, regime, cfg):
  """(clips written out U, passes) for one in-jit call; K = U x passes."""
  if not cfg.no_scale_reps:
    moved = case.grad_bytes * (3 if regime == "clip" else 1)
    K = max(K, min(MAX_REPS[impl], math.ceil(CALL_BYTES / moved)))
  loops = math.ceil(K / (cfg.unroll or UNROLL[impl]))
  return math.ceil(K / loops), loops


def bench_clip(fns, impl, case, regime, cfg):
  """One clip in one regime: in-jit (K clips per jitted call), and one clip per call."""
  R = case.rotation
  seeds = [100 + i for i in range(R)]
  U, loops = scaled_reps({"jax": cfg.jax_reps, "optax": cfg.optax_reps}.get(impl, cfg.reps),
                         impl, case, regime, cfg)
  U = -(-U // R) * R  # a whole number of times round the trees per pass
  K = U * loops
  fn = fns.clip(impl, loops, DECAY**(U // R) if regime == "clip" else 1.0)
  injit_calls = cfg.iters
  if regime == "clip":
    injit_calls = max(PROFILED_CALLS + 1, min(injit_calls, MAX_CLIPS_PER_TREE * R // K))
  one = fns.clip(impl)
  norm0 = min(float(f32_norm(case.random_tree(s))) for s in seeds)
  example = [case.random_tree(s) for s in seeds]
  out = {"reps": K, "reps_written_out": U, "loops": loops,
         "calls_per_round_injit": injit_calls,
         "hlo_injit": compile_summary(fn, example, tuple(max_norm_schedule(regime, 1.0, U))),
         "hlo_call": compile_summary(one, example[:1],
                                     tuple(max_norm_schedule(regime, 1.0, 1)))}
  del example

  def fresh_for(per_call, calls):
    def fresh(state):  # the first U max_norms of each call (the loop scales them pass by pass)
      del state
      return {"arrays": [case.random_tree(s) for s in seeds],
              "ms": [m for c in range(max(calls, WARMUP_CALLS, PROFILED_CALLS))
                     for m in max_norm_schedule(regime, norm0, min(per_call, U),
                                                first=c * per_call, rotation=R)]}
    return fresh

  def call_injit(state, c):
    state["arrays"] = fn(state["arrays"], tuple(state["ms"][c * U:(c + 1) * U]))
    return state

  def call_one(state, c):
    i = c % R
    state["arrays"][i] = one([state["arrays"][i]], (state["ms"][c],))[0]
    return state

  ok = True
  for key, per_call, call, calls in (("injit", K, call_injit, injit_calls),
                                     ("call", 1, call_one, cfg.iters * PER_CALL_FACTOR)):
    t = timing.seconds_per_call(fresh_for(per_call, calls), call, calls, cfg.repeats,
                                profile=key == "injit" and not cfg.no_profile)
    out.update(timing.per_repetition(t, per_call, key))
    ok = ok and regime_holds(regime, t["state"]["arrays"], norm0,
                             per_call * t["calls_since_fresh"], R)
    del t
  out["regime_ok"] = ok
  return out


def add_ratios(clips):
  """x floor, and the speed-ups over optax and torch.

  Speed-ups use the GPU's busy time where there is one (torch: its CUDA
  graph replay), else the in-jit wall time, which can be the host's dispatch rather than
  the GPU's work.
  """
  def same_case(rows, row, impl, framework=None):
    for r in rows:
      if ((r["model"], r["dtype"], r["regime"], r["impl"]) == (row["model"], row["dtype"],
                                                               row["regime"], impl)
          and framework in (None, r.get("framework"))):
        return r
    return None

  def gpu_time(r):
    return r.get("us_device") or r.get("us_injit")

  for row in clips:
    t = gpu_time(row)
    row["x_floor"] = row["us_injit"] / row["floor_us"] if row.get("us_injit") else None
    row["x_floor_device"] = row["us_device"] / row["floor_us"] if row.get("us_device") else None
    optax_row, torch_row = same_case(clips, row, "optax"), same_case(clips, row, "torch")
    row["speedup_vs_optax"] = gpu_time(optax_row) / t if optax_row and t else None
    row["speedup_vs_torch"] = None
    if torch_row and t:  # torch's faster form: CUDA graph replay, or eager calls
      row["speedup_vs_torch"] = min(x for x in (torch_row.get("us_graph"),
                                                torch_row["us_call"]) if x) / t
