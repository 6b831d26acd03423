"""The state `andrea_clip` keeps (`AndreaClipState`), found inside an optimizer's state
(`clip_state`), and its leaf norms named by the leaves' paths (`named_leaf_norms`)."""

from __future__ import annotations

from typing import NamedTuple

import jax

from clipjax import _tree


class AndreaClipState(NamedTuple):
  """State of `andrea_clip`, rewritten by every update.

  Attributes:
    global_norm: float32 scalar (float64 for float64 params), the global norm of
      the latest updates before clipping (so a training loop can log it without
      computing it again).
    clipped: bool scalar, whether the latest updates were scaled (or zeroed).
    nonfinite_count: int32 scalar, how many updates so far had a NaN/inf norm.
    leaf_norms: float32[number of leaves], each leaf's norm before clipping, in
      tree-flatten order (`named_leaf_norms` pairs them with their paths).
    norm_mean, norm_var: float32 scalars, the running mean and variance of the
      global norm (with `spike=ZScoreSpike(...)`; zeros without).
    norm_count: int32 scalar, the finite steps that entered those statistics.
    spike: bool scalar, whether the latest step was a spike.
    spike_count: int32 scalar, how many steps so far were spikes.
  """
  global_norm: jax.Array
  clipped: jax.Array
  nonfinite_count: jax.Array
  leaf_norms: jax.Array
  norm_mean: jax.Array
  norm_var: jax.Array
  norm_count: jax.Array
  spike: jax.Array
  spike_count: jax.Array


def clip_state(opt_state) -> AndreaClipState:
  """The first AndreaClipState inside a (nested) optimizer state."""
  found = []

  def visit(node):
    if isinstance(node, AndreaClipState):
      found.append(node)
      return True
    return False

  jax.tree_util.tree_flatten(opt_state, is_leaf=visit)
  if not found:
    raise ValueError("clipjax: no AndreaClipState in this optimizer state; is andrea_clip in the chain?")
  return found[0]


def named_leaf_norms(opt_state, params) -> dict:
  """{path: norm} of the latest update's leaves, before clipping, e.g.
  {"layer_0/kernel": 0.37, ...}: the `AndreaClipState` inside `opt_state` (see
  `clip_state`) paired with the paths of `params` (the tree the optimizer was made for).

  For logging: the norms are Python floats, from one copy to the host. Inside `jax.jit`,
  where they are traced, each is a traced scalar.
  """
  paths, _, _ = _tree.flatten(params)
  norms = clip_state(opt_state).leaf_norms
  if norms.shape != (len(paths),):
    raise ValueError(f"clipjax: the clip state holds {norms.shape[0]} leaf norms, but params "
                     f"has {len(paths)} leaves; pass the params the optimizer was built for")
  if not isinstance(norms, jax.core.Tracer):
    norms = jax.device_get(norms).tolist()
  return {_tree.name(path): norms[i] for i, path in enumerate(paths)}
