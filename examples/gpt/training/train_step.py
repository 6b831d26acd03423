"""The optimizer and the jitted training step (parameters and optimizer state donated).

The optimizer (recipe v2) is

    optax.chain(clipjax.andrea_clip(max_norm), optax.adamw(schedule, weight_decay))

with a linear warmup to the peak learning rate (step 1 gets peak / warmup_steps) and a
cosine decay after it to peak * end_lr_ratio. Recipe v1 (max_norm 0, weight decay 0) is
plain Adam with no clip. `--spike zscore` gives the clip a spike policy
(`clipjax.ZScoreSpike()`); `--spike skip` also wraps the chain in `clipjax.skip_spikes`,
which skips a spike or NaN/inf step entirely. The step returns the metrics of the log: the
loss, the pre-clip global norm, the clipped and spike flags, the norm's running mean and
every leaf's norm, read from the andrea_clip state (v1 has no clip state, so there
clipjax.global_norm computes the norm), the steps skipped so far, the learning rate, and
per source the summed loss and the row count, for the bandit.

On a mesh (sharding.py) the step is jitted with the shardings of its inputs and outputs:
the batch split over every device, parameters and optimizer state over the fsdp axis,
the metrics replicated. The gradients are constrained to the parameters' shardings, so
XLA reduce-scatters them and the clip and AdamW run on each device's shard; the clip is
the plain andrea_clip, which needs no mesh of its own.

`train_step_for` is the step a run takes: made once per process for each setting that
shapes it, so that runs differing only in their seed, directories or time limit share it.
"""

import dataclasses
import functools

import clipjax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..config import TrainConfig
from . import sharding


def lr_schedule(cfg: TrainConfig):
  """Learning rate of update `count` (0-based; that update is training step count + 1)."""
  peak, warmup, end = cfg.peak_lr, cfg.warmup_steps, cfg.peak_lr * cfg.end_lr_ratio

  def schedule(count):
    step = count + 1
    warming = peak * step / max(warmup, 1)
    progress = jnp.clip((step - warmup) / max(cfg.steps - warmup, 1), 0.0, 1.0)
    decaying = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(step <= warmup, warming, decaying)

  return schedule


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  # weight_decay 0 makes adamw plain Adam: the v1 recipe.
  adam = optax.adamw(lr_schedule(cfg), weight_decay=cfg.weight_decay)
  if cfg.max_norm <= 0:
    return adam
  spike = clipjax.ZScoreSpike() if cfg.spike != "off" else None
  clip = clipjax.andrea_clip(cfg.max_norm, impl=cfg.clip_impl, mode=cfg.clip_mode, spike=spike)
  tx = optax.chain(clip, adam)
  return clipjax.skip_spikes(tx) if cfg.spike == "skip" else tx


def make_train_step(graphdef, tx, cfg: TrainConfig, num_sources: int, mesh=None,
                    params=None, opt_state=None):
  """train_step(params, opt_state, tokens_BxL1, source_B, step) -> (params, opt_state,
  metrics); params and opt_state are donated. With a mesh, `params` and `opt_state`
  (arrays or shape/dtype structs) give the state's shape for its shardings."""
  schedule = lr_schedule(cfg)
  constrain_grads, jit_shardings = (lambda grads: grads), {}
  if mesh is not None:
    param_shardings = sharding.state_shardings(mesh, params)
    state = (param_shardings, sharding.state_shardings(mesh, opt_state))
    batch, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    jit_shardings = dict(in_shardings=(*state, batch, batch, rep),
                         out_shardings=(*state, rep))
    constrain_grads = functools.partial(jax.lax.with_sharding_constraint,
                                        shardings=param_shardings)

  def loss_fn(params, tokens_BxL1):
    model = nnx.merge(graphdef, params)
    loss_BxL = model.token_losses(tokens_BxL1[:, :-1], tokens_BxL1[:, 1:])
    loss_B = loss_BxL.mean(axis=1)
    return loss_B.mean(), loss_B

  @functools.partial(jax.jit, donate_argnums=(0, 1), **jit_shardings)
  def train_step(params, opt_state, tokens_BxL1, source_B, step):
    (loss, loss_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BxL1)
    grads = constrain_grads(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if cfg.max_norm > 0:
      clip = clipjax.clip_state(opt_state)
      clip_metrics = {"grad_norm": clip.global_norm, "clipped": clip.clipped,
                      "spike": clip.spike, "norm_mean": clip.norm_mean,
                      "leaf_norms": clip.leaf_norms}
    else:
      clip_metrics = {"grad_norm": clipjax.global_norm(grads, impl=cfg.clip_impl),
                      "clipped": False, "spike": False, "norm_mean": 0.0, "leaf_norms": None}
    skipped = opt_state.skipped_count if cfg.spike == "skip" else 0
    metrics = {
        "loss": loss, **clip_metrics, "skipped_count": skipped, "lr": schedule(step - 1),
        "loss_sum_K": jax.ops.segment_sum(loss_B, source_B, num_sources),
        "rows_K": jax.ops.segment_sum(jnp.ones_like(loss_B), source_B, num_sources),
    }
    return params, opt_state, metrics

  return train_step


# Settings the compiled step does not depend on: where the run writes, how long it runs,
# what it reads and logs. (The mesh setting is in the step's key as the mesh itself.)
OUTSIDE_THE_STEP = ("out_dir", "cache_dir", "resume", "overwrite", "seed", "checkpoint_every",
                    "keep_checkpoints", "stop_after_step", "time_limit_s", "nonfinite_stop",
                    "num_samples", "prompts", "sample_tokens", "sample_temperature",
                    "log_every", "peak_tflops", "sources", "max_source_mb", "bandit_config",
                    "mesh", "coordinator", "num_processes", "process_id",
                    "heartbeat_timeout_s")
_made_steps: dict = {}


def train_step_for(graphdef, cfg: TrainConfig, num_sources: int, mesh=None, params=None,
                   opt_state=None):
  """`make_train_step`'s step for `cfg` with `make_optimizer(cfg)`, made once per process:
  a later run whose settings differ only in OUTSIDE_THE_STEP (another seed, directory or
  time limit, a resume) gets the same jitted step, and so neither traces nor compiles it
  again."""
  key = (graphdef, dataclasses.replace(cfg, **dict.fromkeys(OUTSIDE_THE_STEP)), num_sources,
         mesh)
  if key not in _made_steps:
    _made_steps[key] = make_train_step(graphdef, make_optimizer(cfg), cfg, num_sources, mesh,
                                       params, opt_state)
  return _made_steps[key]
