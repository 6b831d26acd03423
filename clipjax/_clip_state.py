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

  Examples:
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> clip = clipjax.andrea_clip(1.0)
    >>> _, state = clip.update({"w": jnp.array([0.0, 0.5])}, clip.init({"w": jnp.zeros(2)}))
    >>> print(state.global_norm, state.clipped, state.nonfinite_count, state.leaf_norms)
    0.5 False 0 [0.5]
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
  """The first AndreaClipState inside a (nested) optimizer state.

  Args:
    opt_state: an optimizer's state, e.g. of `optax.chain(clipjax.andrea_clip(1.0), ...)`,
      nested to any depth (`optax.inject_hyperparams`, `skip_spikes` and the like).

  Returns:
    The `AndreaClipState` that `andrea_clip` keeps there (the first, in tree order).

  Raises:
    ValueError: the state holds no `AndreaClipState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import clipjax
    >>> tx = optax.chain(clipjax.andrea_clip(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(2)}
    >>> _, opt_state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    >>> print(clipjax.clip_state(opt_state).global_norm)
    5.0
  """
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
  """Each leaf's norm in the latest update, before clipping, named by the leaf's path.

  The `AndreaClipState` inside `opt_state` (see `clip_state`) paired with the paths of
  `params` (the tree the optimizer was made for), e.g. `{"layer_0/kernel": 0.37, ...}`.
  For logging: the norms are Python floats, from one copy to the host. Inside `jax.jit`,
  where they are traced, each is a traced scalar.

  Args:
    opt_state: an optimizer's state that holds an `AndreaClipState`.
    params: the parameters the optimizer was made for (their paths name the norms).

  Returns:
    A dict from each leaf's path (`/`-separated, as Flax and Orbax name it) to its norm.

  Raises:
    ValueError: the state holds no `AndreaClipState`, or `params` has another number of
      leaves than the clip's state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import clipjax
    >>> params = {"b": jnp.zeros(1), "w": jnp.zeros(2)}
    >>> clip = clipjax.andrea_clip(1.0)
    >>> grads = {"b": jnp.array([1.0]), "w": jnp.array([3.0, 4.0])}
    >>> _, state = clip.update(grads, clip.init(params))
    >>> clipjax.named_leaf_norms(state, params)
    {'b': 1.0, 'w': 5.0}
  """
  paths, _, _ = _tree.flatten(params)
  norms = clip_state(opt_state).leaf_norms
  if norms.shape != (len(paths),):
    raise ValueError(f"clipjax: the clip state holds {norms.shape[0]} leaf norms, but params "
                     f"has {len(paths)} leaves; pass the params the optimizer was built for")
  if not isinstance(norms, jax.core.Tracer):
    norms = jax.device_get(norms).tolist()
  return {_tree.name(path): norms[i] for i, path in enumerate(paths)}
