"""Two steps of examples/benchmark.py that split the clip's cost into its state and the rest.

A step with `andrea_clip` passes its state (`AndreaClipState`: nine arrays) into and out of
every call, donated, where the host pays for each array; and it runs the clip. These two
variants hold one of the two:
  - `carried_like_clip`: adamw's step carrying arrays of the clip state's shapes and types,
    each rewritten every step from its old value as the clip's are, and no clip;
  - `clip_without_state`: the clip's updates with its state made afresh inside the step and
    dropped, so that no array of it crosses the call.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

import clipjax


def carried_like_clip(max_norm) -> optax.GradientTransformation:
  """Updates passed through unchanged; a state of arrays shaped and typed like
  `andrea_clip(max_norm)`'s, each rewritten from its old value every step."""
  clip = clipjax.andrea_clip(max_norm)

  def init_fn(params):
    return tuple(clip.init(params))

  def update_fn(updates, state, params=None):
    del params
    return updates, tuple(~s if s.dtype == jnp.bool_ else s + 1 for s in state)

  return optax.GradientTransformation(init_fn, update_fn)


def clip_without_state(max_norm) -> optax.GradientTransformation:
  """`andrea_clip(max_norm)`'s updates, with an empty state: the clip's state is made
  afresh in the step and dropped."""
  clip = clipjax.andrea_clip(max_norm)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del state
    updates, _ = clip.update(updates, clip.init(updates), params)
    return updates, optax.EmptyState()

  return optax.GradientTransformation(init_fn, update_fn)
