"""clipjax on its own: a small Flax NNX model trained with andrea_clip ahead of AdamW.

    python examples/minimal.py            # a few seconds on a CPU

A two-layer MLP is fitted to a smooth function of its inputs, on one fixed batch. Its
first gradients are large (the targets are far from an untrained model's outputs), so the
first steps clip; once the loss has come down, the gradients' global norm falls below
max_norm and the updates pass unchanged. What the clip saw is read back from the
optimizer state with `clipjax.clip_state`.
"""

import clipjax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

MAX_NORM = 1.0
LEARNING_RATE = 2e-2
FEATURES, HIDDEN = 8, 32


class MLP(nnx.Module):
  """x_BxF -> y_B: Linear, GELU, Linear."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x_BxF):
    return self.out(jax.nn.gelu(self.hidden(x_BxF)))[:, 0]


def make_batch(key, batch_size=256):
  """(x_BxF, y_B): standard normal inputs, and targets 3 + sum(sin(x)) / 2, far from an
  untrained model's outputs near 0."""
  x_BxF = jax.random.normal(key, (batch_size, FEATURES))
  return x_BxF, 3.0 + 0.5 * jnp.sin(x_BxF).sum(axis=1)


def loss_fn(params, graphdef, x_BxF, y_B):
  """Mean squared error of the model `graphdef` with `params`."""
  return jnp.mean((nnx.merge(graphdef, params)(x_BxF) - y_B) ** 2)


def make_optimizer():
  """The drop-in: clip the gradients' global norm to MAX_NORM, then AdamW."""
  return optax.chain(clipjax.andrea_clip(MAX_NORM),
                     optax.adamw(LEARNING_RATE, weight_decay=1e-4))


def make_step(graphdef, tx):
  """step(params, opt_state, x_BxF, y_B) -> (params, opt_state, loss), jitted, with the
  parameters and optimizer state donated."""

  def step(params, opt_state, x_BxF, y_B):
    loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, x_BxF, y_B)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def train(steps=40, seed=0, log_every=10, log=print):
  """Trains for `steps` steps; returns one record per step: the loss, and the clip's
  global norm (before clipping) and whether it clipped."""
  graphdef, params = nnx.split(MLP(nnx.Rngs(seed)), nnx.Param)
  tx = make_optimizer()
  opt_state = tx.init(params)
  step = make_step(graphdef, tx)
  x_BxF, y_B = make_batch(jax.random.key(seed))
  records = []
  for i in range(1, steps + 1):
    params, opt_state, loss = step(params, opt_state, x_BxF, y_B)
    clip = clipjax.clip_state(opt_state)  # the AndreaClipState inside the chain
    records.append({"step": i, "loss": float(loss), "global_norm": float(clip.global_norm),
                    "clipped": bool(clip.clipped)})
    if i == 1 or i % log_every == 0:
      log(f"step {i:3d}  loss {loss:8.4f}  global norm {clip.global_norm:8.4f}  "
          + ("clipped" if clip.clipped else "passed"))
  clipped = sum(r["clipped"] for r in records)
  log(f"{clipped} of {steps} steps clipped to max_norm {MAX_NORM}")
  return records


if __name__ == "__main__":
  train()
