"""`skip_spikes`: a whole optimizer step undone on the device when the clip flags it.

The wrapped chain runs as usual; then, on a flagged step (a non-finite norm, or a spike by
the clip's `ZScoreSpike`), every update is zero and every state of the chain is the one it
had before the step, except the clip's own state, whose statistics and counters advance.
The flags are scalars in the clip's state; the choice is made per array by `pick`, elementwise
bit operations that XLA fuses into the optimizer's own pass (no conditional, no host sync).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from clipjax._clip_state import AndreaClipState, clip_state


class SkipSpikesState(NamedTuple):
  """State of `skip_spikes`: the wrapped chain's state, and how many steps it skipped.

  Attributes:
    inner_state: the state of the wrapped chain (its `AndreaClipState` among it).
    skipped_count: int32 scalar, how many steps so far were skipped.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import clipjax
    >>> tx = clipjax.skip_spikes(optax.chain(clipjax.andrea_clip(1.0), optax.sgd(0.1)))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> print(state.skipped_count, clipjax.clip_state(state.inner_state).nonfinite_count)
    0 0
  """
  inner_state: Any
  skipped_count: jax.Array  # int32


@jax.custom_jvp
def pick(skip, if_skip, otherwise):
  """`if_skip` where the scalar `skip` holds, else `otherwise`, bit for bit.

  XLA fuses the choice into the optimizer's pass, where its form matters: for arrays of 4-
  and 8-byte elements a select of every moment and update slows the AdamW step more than
  the same choice on the bits, otherwise ^ ((otherwise ^ if_skip) & mask) with mask all
  ones on a skipped step; for 2-byte elements the integer operations cost more than a
  select (benchmarks/bench_step.py --clips andrea,andrea_skip). So arrays of 4- and
  8-byte elements are chosen on their bits (a select's bits, NaN payloads and signed zeros
  included), and narrower, boolean or complex ones by a select.
  """
  otherwise = jnp.asarray(otherwise)
  dtype = otherwise.dtype
  bits = {4: jnp.uint32, 8: jnp.uint64}.get(dtype.itemsize)
  if bits is None or jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.where(skip, if_skip, otherwise)
  a = lax.bitcast_convert_type(jnp.asarray(if_skip, dtype), bits)
  b = lax.bitcast_convert_type(otherwise, bits)
  mask = -jnp.asarray(skip).astype(bits)  # all ones, or zero
  return lax.bitcast_convert_type(b ^ ((b ^ a) & mask), dtype)


@pick.defjvp
def _pick_jvp(primals, tangents):
  """The tangent of the array chosen (the choice on the bits has none of its own)."""
  skip, if_skip, otherwise = primals
  _, if_skip_dot, otherwise_dot = tangents
  if not jnp.issubdtype(jnp.asarray(otherwise).dtype, jnp.inexact):
    return pick(*primals), otherwise_dot  # integers: a float0 zero
  return pick(*primals), jnp.where(skip, if_skip_dot, otherwise_dot)


def skip_spikes(inner: optax.GradientTransformation, *, on_nonfinite: bool = True,
                on_spike: bool = True) -> optax.GradientTransformation:
  """Wraps a chain that holds `andrea_clip`, so that a flagged step is skipped entirely.

    tx = clipjax.skip_spikes(optax.chain(
        clipjax.andrea_clip(1.0, spike=clipjax.ZScoreSpike()), optax.adamw(3e-4)))

  Args:
    inner: the chain; its state must hold an `AndreaClipState` (see `clip_state`).
    on_nonfinite: skip a step whose global norm is NaN or inf.
    on_spike: skip a step the clip's spike policy flags (needs `spike=` on the clip).

  Returns:
    A GradientTransformation whose state is a `SkipSpikesState`. On a skipped step the
    updates are zeros and the inner state is bit for bit the one before the step (AdamW's
    moments and step count included), but for the clip's state, which records the step.

  Raises:
    ValueError: `on_nonfinite` and `on_spike` both false (it would never skip); at `init`,
      a chain whose state holds no `AndreaClipState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import clipjax
    >>> tx = clipjax.skip_spikes(optax.chain(clipjax.andrea_clip(1.0), optax.sgd(0.1)))
    >>> params = {"w": jnp.ones(2)}
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
    >>> print(updates["w"], state.skipped_count)
    [0. 0.] 1
  """
  if not (on_nonfinite or on_spike):
    raise ValueError("clipjax: skip_spikes with on_nonfinite=False and on_spike=False would "
                     "never skip; leave the wrapper out instead")

  def init_fn(params):
    state = inner.init(params)
    clip_state(state)  # a clear error now if the chain holds no andrea_clip
    return SkipSpikesState(state, jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    new_updates, new_inner = inner.update(updates, state.inner_state, params)
    before, after = clip_state(state.inner_state), clip_state(new_inner)
    skip = jnp.zeros((), bool)
    if on_nonfinite:
      skip = skip | (after.nonfinite_count > before.nonfinite_count)
    if on_spike:
      skip = skip | after.spike
    new_updates = jax.tree.map(lambda u: pick(skip, jnp.zeros_like(u), u), new_updates)

    def keep_old(old, new):
      if isinstance(new, AndreaClipState):
        return new
      return pick(skip, old, new)

    kept = jax.tree.map(keep_old, state.inner_state, new_inner,
                        is_leaf=lambda x: isinstance(x, AndreaClipState))
    return new_updates, SkipSpikesState(kept, state.skipped_count + skip.astype(jnp.int32))

  return optax.GradientTransformation(init_fn, update_fn)
