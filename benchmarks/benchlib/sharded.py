"""The clips bench_sharded.py compares on gradients laid out over a mesh, checked against
float64 and timed K clips per jitted call, the tree donated and kept in its sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import clipjax
from benchlib import timing
from benchlib.timing import NORM_RATIO, PROFILED_CALLS, WARMUP_CALLS, regime_holds
from benchlib.trees import max_rel_err_vs_f64

IMPLS = ("plain", "plain_jax", "andrea", "jax", "optax", "single")
SHARDED_IMPLS = IMPLS[:-1]
LABELS = {"plain": "clip_tree under jit", "plain_jax": "clip_tree(jax) under jit",
          "andrea": "sharded_clip_tree", "jax": "sharded_clip_tree(jax)", "optax": "optax",
          "single": "clip_tree, 1 device"}
SEED = 100
# Correctness: the global norm and the updates against float64 NumPy. The updates are
# within the factor's rounding and one rounding to the leaf type. optax's updates are
# measured the same way and reported, not checked: on bf16 leaves it sums in bf16.
NORM_RTOL = 1e-6
UPDATE_RTOL = {"f32": 1e-6, "bf16": 2.0**-7}


def clip_fn(impl, layout, andrea_impl):
  """(tree, max_norm) -> (clipped tree, global norm or None) for one impl on one layout.

  plain, plain_jax: clipjax.clip_tree, the drop-in (no mesh, no specs), partitioned by XLA;
  andrea, jax: clipjax.sharded_clip_tree, the explicit shard_map form; single: clip_tree on
  one device holding the whole tree; optax: optax.clip_by_global_norm, partitioned by XLA.
  """
  which = "jax" if impl in ("plain_jax", "jax") else andrea_impl
  if impl in ("plain", "plain_jax", "single"):
    def clip(tree, m):
      r = clipjax.clip_tree(tree, m, impl=which)
      return r.updates, r.global_norm
  elif impl in ("andrea", "jax"):
    def clip(tree, m):
      r = clipjax.sharded_clip_tree(tree, m, mesh=layout.mesh, specs=layout.specs, impl=which)
      return r.updates, r.global_norm
  else:
    def clip(tree, m):
      tx = optax.clip_by_global_norm(m)
      return tx.update(tree, tx.init(tree))[0], None
  return clip


def repeated_fn(clip, layout, name):
  """jit(tree, max_norms) -> tree: n clips, each output the next one's input through an
  optimization barrier, the tree donated and kept in its sharding."""
  def run(tree, max_norms):
    for m in max_norms:
      tree = jax.lax.optimization_barrier(clip(tree, m)[0])
    return tree
  run.__name__ = name
  return jax.jit(run, in_shardings=(layout.shardings, layout.scalar),
                 out_shardings=layout.shardings, donate_argnums=0)


def max_norms(layout, regime, norm0, n):
  return tuple(jax.device_put(timing.max_norm_schedule(regime, norm0, n), layout.scalar))


def run_checks(layout, dtype, impls, ref_norm, andrea_impl, log):
  """One clip per impl on the same tree: the norm and the updates against float64, and the
  updates' sharding against the input's. Returns the checks (one dict each)."""
  m = jax.device_put(jnp.asarray(ref_norm / NORM_RATIO), layout.scalar)
  tree = layout.tree(SEED)
  checks = []

  def check(what, value, tol, ok):
    checks.append({"layout": layout.name, "dtype": dtype, "what": what, "value": value,
                   "tol": tol, "ok": bool(ok)})

  for impl in impls:
    fn = jax.jit(clip_fn(impl, layout, andrea_impl),
                 in_shardings=(layout.shardings, layout.scalar),
                 out_shardings=(layout.shardings, layout.scalar))
    updates, norm = fn(tree, m)
    if norm is not None:
      err = abs(float(norm) - ref_norm) / ref_norm
      check(f"{impl} global norm vs float64", err, NORM_RTOL, err <= NORM_RTOL)
    check(f"{impl} output sharding as input", None, None,
          all(u.sharding.is_equivalent_to(t.sharding, u.ndim) for u, t in
              zip(jax.tree.leaves(updates), jax.tree.leaves(tree))))
    err = max_rel_err_vs_f64(updates, tree, float(m) / ref_norm)
    if impl == "optax":
      check("optax updates vs float64 (not checked)", err, None, True)
    else:
      check(f"{impl} updates vs float64", err, UPDATE_RTOL[dtype], err <= UPDATE_RTOL[dtype])
    log(f"  checked {layout.name} {dtype} {LABELS[impl]}")
  return checks


def time_clip(fn, layout, regime, norm0, K, cfg):
  """Microseconds per clip: in-jit wall time (median of rounds) and, on GPUs, the busiest
  device's busy time."""
  calls = cfg.iters

  def fresh(state):
    del state
    n = K * max(calls, WARMUP_CALLS, PROFILED_CALLS)
    return {"arrays": layout.tree(SEED), "ms": max_norms(layout, regime, norm0, n)}

  def call(state, c):
    state["arrays"] = fn(state["arrays"], state["ms"][c * K:(c + 1) * K])
    return state

  t = timing.seconds_per_call(fresh, call, calls, cfg.repeats, profile=not cfg.no_profile)
  out = dict(timing.per_repetition(t, K, "injit"), reps=K)
  out["regime_ok"] = regime_holds(regime, [t["state"]["arrays"]], norm0,
                                  K * t["calls_since_fresh"])
  return out


def add_ratios(rows):
  """x floor, speed-up over optax (same layout) and over the one-device clip, on device
  times where there are any."""
  def t(r):
    return r.get("us_device") or r.get("us_injit")

  def find(row, layout, impl):
    for r in rows:
      if (r["layout"], r["dtype"], r["regime"], r["impl"]) == (layout, row["dtype"],
                                                               row["regime"], impl):
        return r
    return None

  for row in rows:
    row["x_floor"] = t(row) / row["floor_us"]
    optax_row = find(row, row["layout"], "optax") if row["impl"] != "single" else None
    single = find(row, "single", "single")
    row["speedup_vs_optax"] = t(optax_row) / t(row) if optax_row else None
    row["speedup_vs_single"] = t(single) / t(row) if single else None
