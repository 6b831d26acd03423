"""The full training step on sharded gradients: a jitted, donated
optax.chain(clip, optax.adamw(1e-4)) update and apply_updates, with clipjax.andrea_clip(1.0)
or optax.clip_by_global_norm(1.0) as the clip, parameters, optimizer state and gradients
laid out alike (FSDP).

The gradients stand in for those a backward pass would make inside the step: fresh standard
normals, donated, and scaled by a traced 1.0 (a loss scale) into a buffer of the step's own
behind an optimization barrier, as a backward pass materializes its gradients. Both chains
pay for that pass; the clip then finds its gradients in an intermediate that it may
overwrite, as in training, and not in an argument of the step (which XLA would copy first).
Their norm (about 1e4 for gpt120m) is far above 1.0, so every step clips.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax

import clipjax
from benchlib import timing
from benchlib.profiling import compile_summary
from benchlib.timing import PROFILED_CALLS, WARMUP_CALLS
from benchlib.trees import f64_norm, max_rel_err_vs_f64

# XLA need not reuse every donated gradient buffer for an output, and jax warns at each
# compile where it does not; the memory columns say what each step needs.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
LEARNING_RATE = 1e-4
# The clip ahead of the optimizer: max_norm -> GradientTransformation (None: no clip).
CLIPS = {
    "none": ("", None),
    "andrea": ("andrea_clip", lambda m: clipjax.andrea_clip(m)),
    "andrea_kernel": ("andrea_clip(scale=kernel)",
                      lambda m: clipjax.andrea_clip(m, scale="kernel")),
    "andrea_jax": ("andrea_clip(impl=jax)", lambda m: clipjax.andrea_clip(m, impl="jax")),
    "optax": ("clip_by_global_norm", lambda m: optax.clip_by_global_norm(m)),
    "andrea_zscore": ("andrea_clip(spike=ZScoreSpike())",
                      lambda m: clipjax.andrea_clip(m, spike=clipjax.ZScoreSpike())),
}
# The same clip, with skip_spikes around the whole chain (see `chain`).
CLIPS["andrea_skip"] = ("skip_spikes: " + CLIPS["andrea_zscore"][0], CLIPS["andrea_zscore"][1])
OPTIMIZERS = {
    "adamw": lambda lr: optax.adamw(lr, weight_decay=0.1),
    "adam": lambda lr: optax.adam(lr),
    "sgd_momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "lion": lambda lr: optax.lion(lr / 3),
    # adamw with max_norm and the learning rate as state (optax.inject_hyperparams)
    "inject_adamw": lambda lr: optax.adamw(lr, weight_decay=0.1),
}
# bench_sharded.py's chains: each clip ahead of adamw.
CHAINS = {"andrea": "andrea_clip(1.0) + adamw", "optax": "clip_by_global_norm(1.0) + adamw"}
PARAMS_SEED, GRADS_SEED = 3, 200
B1 = 0.9  # adamw's default: the first moment after one step is (1 - B1) x the clipped gradients
# Correctness, one step from the same parameters and gradients: each chain's first moment
# against the float64 (1 - B1) x gradients x 1.0 / norm (elementwise: two roundings to the
# leaf type at most), and the two chains' parameters against each other (normwise).
# optax's moments are reported, not checked: on bf16 leaves its norm is a sum in bf16.
MOMENT_RTOL = {"f32": 2e-6, "bf16": 2.0**-6}
PARAMS_RTOL = {"f32": 1e-6, "bf16": 2.0**-7}


def label(clip, opt):
  name = CLIPS[clip][0]
  return f"{name} + {opt}" if name else f"{opt} alone"


def chain(clip, opt="adamw", max_norm=1.0):
  """optax.chain(clip(max_norm), opt): one GradientTransformation."""
  make_clip, make_opt = CLIPS[clip][1], OPTIMIZERS[opt]

  def build(max_norm, learning_rate):
    inner = make_opt(learning_rate)
    return optax.chain(make_clip(max_norm), inner) if make_clip else inner

  if opt == "inject_adamw":
    tx = optax.inject_hyperparams(build)(max_norm=max_norm, learning_rate=LEARNING_RATE)
  else:
    tx = build(max_norm, LEARNING_RATE)
  return clipjax.skip_spikes(tx) if clip == "andrea_skip" else tx


ONE = np.float32(1.0)  # the traced loss scale of every step


def step_fn(tx, layout, params):
  """(jit(params, opt_state, grads, loss_scale) -> (params, opt_state), opt_state): one
  step, the first three arguments donated, each leaf laid out by its shape as `layout`
  says."""
  opt_state = jax.jit(tx.init, out_shardings=layout.shardings_like(
      jax.eval_shape(tx.init, params)))(params)

  def step(params, opt_state, grads, loss_scale):
    grads = jax.lax.optimization_barrier(
        jax.tree.map(lambda g: (g * loss_scale).astype(g.dtype), grads))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  p_sh, s_sh = layout.shardings_like(params), layout.shardings_like(opt_state)
  fn = jax.jit(step, in_shardings=(p_sh, s_sh, layout.shardings, None),
               out_shardings=(p_sh, s_sh), donate_argnums=(0, 1, 2))
  return fn, opt_state


def one_step(clip, layout):
  """(params, opt_state) after one step of chain(clip) from the benchmark's seeds."""
  params = layout.tree(PARAMS_SEED, scale=0.02)
  fn, opt_state = step_fn(chain(clip), layout, params)
  return fn(params, opt_state, layout.tree(GRADS_SEED), ONE)


def check_chains(layout, dtype):
  """One step of each chain from the same parameters and gradients: each chain's first
  moment against float64, and the chains' parameters against each other."""
  grads = layout.tree(GRADS_SEED)
  factor = (1 - B1) * 1.0 / f64_norm(grads)
  checks, params_after = [], {}

  def check(what, value, tol):
    checks.append({"layout": layout.name, "dtype": dtype, "what": what, "value": value,
                   "tol": tol, "ok": tol is None or value <= tol})

  for name in CHAINS:
    params_after[name], opt_state = one_step(name, layout)
    mu = opt_state[1][0].mu  # chain state: (clip, adamw); adamw: (scale_by_adam, ...)
    err = max_rel_err_vs_f64(mu, grads, factor)
    check(f"step {name}: first moment vs float64" + (" (not checked)" if name == "optax"
                                                     else ""),
          err, None if name == "optax" else MOMENT_RTOL[dtype])
  diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)),
                          initial=0.0))
             for x, y in zip(jax.tree.leaves(params_after["andrea"]),
                             jax.tree.leaves(params_after["optax"])))
  scale = max(float(np.max(np.abs(np.asarray(y, np.float64)), initial=0.0))
              for y in jax.tree.leaves(params_after["optax"]))
  check("step: parameters, andrea vs optax chain (normwise)", diff / scale, PARAMS_RTOL[dtype])
  return checks


def bench(clip, layout, cfg, opt="adamw", max_norm=1.0):
  """One chain's step, one per jitted call: wall time per step (median of rounds), the
  devices' busy time per step, and the per-device memory XLA planned for it."""
  params = layout.tree(PARAMS_SEED, scale=0.02)
  fn, opt_state = step_fn(chain(clip, opt, max_norm), layout, params)
  summary = compile_summary(fn, params, opt_state, layout.tree(GRADS_SEED), ONE)
  calls = cfg.iters
  carried = {"params": params, "opt_state": opt_state}
  del params, opt_state

  def fresh(state):  # parameters and moments carry on; a fresh gradient tree for each call
    if state is not None:
      carried["params"], carried["opt_state"] = state["arrays"]
    del state
    pool = [layout.tree(GRADS_SEED + i) for i in range(max(calls, WARMUP_CALLS,
                                                           PROFILED_CALLS))]
    return {"arrays": (carried.pop("params"), carried.pop("opt_state")), "grads": pool}

  def call(state, c):
    state["arrays"] = fn(*state["arrays"], state["grads"][c], ONE)
    state["grads"][c] = None
    return state

  t = timing.seconds_per_call(fresh, call, calls, cfg.repeats, profile=not cfg.no_profile)
  out = timing.per_repetition(t, 1, "injit")
  clip_state = [s for s in jax.tree.leaves(t["state"]["arrays"][1],
                                           is_leaf=lambda x: isinstance(x, clipjax.AndreaClipState))
                if isinstance(s, clipjax.AndreaClipState)]
  out.update(chain=clip, clip=clip, opt=opt, label=label(clip, opt), hlo=summary,
             memory=summary.pop("memory"), compile_s=summary["compile_s"],
             learning_rate=LEARNING_RATE, max_norm=max_norm,
             clipped_last_step=bool(clip_state[0].clipped) if clip_state else None)
  return out


def add_ratios(rows):
  """Each step's speed-up over optax's chain (same dtype), on device times where there are
  any."""
  def t(r):
    return r.get("us_device") or r["us_injit"]

  for row in rows:
    optax_row = next((r for r in rows if r["dtype"] == row["dtype"] and r["chain"] == "optax"
                      and r.get("opt") == row.get("opt")), None)
    row["speedup_vs_optax"] = t(optax_row) / t(row) if optax_row else None
