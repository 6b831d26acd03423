"""Pure-JAX twin of the custom call (the path CPUs and TPUs take), and the clip
decision that every path shares.

Same contract as `clipjax._ffi.andrea_clip`: returns `(out_leaves, norms, flags)`.

Only per-leaf reductions and elementwise ops touch the leaves, so XLA's SPMD
partitioner runs this on sharded gradients as it runs optax's clip: each device
reduces its own shards and an all-reduce combines a few floats per leaf. No leaf is
reshaped, concatenated or passed through a conditional.

Overflow and underflow are handled on scalars, not leaves. Every leaf yields three
float32 sums of squares in one pass, of x, x * 2**-88 and x * 2**64:

  mid   covers |x| in about [2**-63, 2**63]: used when it is finite and >= 2**-60;
  big   is finite for any finite leaf (below 2**47 elements): used when mid overflowed;
  small is exact for tiny leaves: used when mid < 2**-60 (every |x| < 2**-30).

A norm is kept as (root, exponent), norm = root * 2**exponent, so that a norm above
the float32 range still gives the right scale factor.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
# (exponent k of the factor 2**k applied before squaring) for the mid, big and small sums.
_SUM_EXPONENTS = (0, -88, 64)
# mid at or above this (and finite) lost nothing that matters to underflow: an element
# whose square underflows adds below 2**-126, a relative 2**-66 per element.
_MID_SUMSQ_MIN = 2.0**-60


def _pow2(k):
  """2.0**k as float32 for integer k, built from its bits; 0 below 2**-126."""
  k = jnp.asarray(k, jnp.int32)
  bits = (jnp.clip(k, -126, 127) + 127) << 23
  return jnp.where(k < -126, _F32(0), lax.bitcast_convert_type(bits, _F32))


def _unscale(v, e):
  """v * 2**e for e in [-252, 252], in two exact steps (2**e alone may not be a float32);
  NaN and inf are kept as they are (inf * 2**-200 is inf, not inf * 0)."""
  return jnp.where(jnp.isfinite(v), v * _pow2(e // 2) * _pow2(e - e // 2), v)


def _real_parts(x):
  """The float32 arrays whose squares sum to |x|^2: x itself, or a complex leaf's parts
  (so that |z| above the float32 range does not overflow where its parts do not)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return [jnp.real(x).astype(_F32), jnp.imag(x).astype(_F32)]
  return [x.astype(_F32)]


def leaf_sums(x):
  """(mid, big, small): the leaf's three float32 sums of squares.

  Three reductions of the same leaf. XLA:GPU fuses them into one multi-output reduction
  per leaf; XLA:CPU runs one pass over the leaf for each.
  """
  # The factors pass an optimization barrier: otherwise XLA may rewrite (x * c)^2 as
  # x^2 * c^2 and fold c^2, which is 0 or inf in float32.
  factors = lax.optimization_barrier([_F32(2.0**k) for k in _SUM_EXPONENTS])
  return tuple(sum(jnp.sum(jnp.square(part * c)) for part in _real_parts(x)) for c in factors)


def pick_norm(mid, big, small):
  """(root, exponent) of the norm from its three sums of squares, elementwise.

  The root is finite whenever the elements are (even where the norm overflows float32),
  and NaN or inf where one is not.
  """
  use_mid = jnp.isfinite(mid) & (mid >= _MID_SUMSQ_MIN)
  use_small = mid < _MID_SUMSQ_MIN  # False for a NaN or inf mid
  root = jnp.where(use_mid, jnp.sqrt(mid), jnp.where(use_small, jnp.sqrt(small), jnp.sqrt(big)))
  exp = jnp.where(use_mid, 0, jnp.where(use_small, -_SUM_EXPONENTS[2], -_SUM_EXPONENTS[1]))
  return root, exp.astype(jnp.int32)


def norms(leaves):
  """((global root, global exponent), (leaf roots, leaf exponents)); see the module doc."""
  # The barrier keeps each leaf's reductions a fusion of their own: stacked at once, XLA:GPU
  # may fuse them into the stack, where one thread reduces a whole leaf.
  sums = lax.optimization_barrier([leaf_sums(x) for x in leaves])
  per_leaf = [jnp.stack([s[j] for s in sums]) for j in range(3)]
  # The totals add the leaves' sums in ascending order: a little more accurate, and a sort
  # is not an op that XLA:CPU copies into every consumer. A plain sum becomes a chain of n
  # scalar adds that it copies into the fusion scaling each leaf: O(n^2) compile time.
  totals = [jnp.sum(jnp.sort(p)) for p in per_leaf]
  return pick_norm(*totals), pick_norm(*per_leaf)


def scale_leaf(x, scale, keep, zero_fill, shift):
  """x as the decision says: kept, zero-filled, or (x * scale) * 2**shift (see `decide`)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    scaled = _unscale(x * scale.astype(x.dtype), shift)
  else:
    scaled = _unscale(x.astype(_F32) * scale, shift).astype(x.dtype)
  out = jnp.where(keep, x, scaled)
  return jnp.where(zero_fill, jnp.zeros_like(x), out)


def decide(norm, max_norm, zero_nonfinite, all_finite, root, exp):
  """The clip decision, elementwise: cuda/andrea_clip_common.h::DecideScale's for every
  factor in float32's normal range, and exact below it (where the custom call's flushes
  factors under about 2**-190).

  Returns (scale, shift, keep, zero_fill): a clipped leaf becomes (x * scale) * 2**shift.
  `norm` is root * 2**exp (inf where that is above float32). With finite gradients the
  factor max_norm / norm is r * 2**E, r the ratio of the mantissas of max_norm and root:
  - where that is a normal float32, `scale` is it (the float32 max_norm / norm, as the
    custom call rounds it) and shift is 0;
  - below float32's normal range, where XLA would flush it to zero, `scale` keeps r at
    the least power of two that stays normal and shift holds the rest, which is applied
    after it, in two exact steps: an element whose product is a float32 keeps it.
  """
  keep = norm <= max_norm
  max_mantissa, max_exp = jnp.frexp(max_norm)
  root_mantissa, root_exp = jnp.frexp(root)
  r = max_mantissa / root_mantissa  # in (0.5, 2)
  e = max_exp - root_exp - exp
  normal = e >= -125  # r * 2**e >= 2**-126
  # Below that, scale = r * 2**a with a in [-125, -1]: normal, and x * scale cannot overflow.
  a = jnp.where(normal, e, jnp.maximum(e + 126, -125))
  finite = jnp.isfinite(root) & (root > 0)
  scale = jnp.where(finite, _unscale(r, a), max_norm / norm)
  shift = jnp.where(finite & ~normal, e - a, 0)
  scale, shift = jnp.where(keep, _F32(1), scale), jnp.where(keep, 0, shift)
  zero_fill = jnp.logical_and(zero_nonfinite, jnp.logical_not(all_finite))
  return scale, shift.astype(jnp.int32), keep & ~zero_fill, zero_fill


def decide_and_scale(max_norm, leaves, global_root, global_exp, leaf_roots, leaf_exps, *,
                     mode: str, on_nonfinite: str, scale_leaves: bool, scale_fn=None):
  """The decision from the norms (as (root, exponent) pairs), then the scale.

  Every path ends here: the pure-JAX clip, and the sharded clips after their all-reduce.
  `scale_fn(scale, pre, keep, zero_fill, leaves)`, when given, scales the leaves as
  (x * pre) * scale (the scale-only custom call; it gets the shift as a float32 power of
  two, exact down to 2**-126); by default each leaf is scaled by `scale_leaf`.

  Returns (out_leaves or None, norms f32[n + 1], flags int32[2]) as the custom call does.
  """
  global_norm, leaf_norms = _unscale(global_root, global_exp), _unscale(leaf_roots, leaf_exps)
  all_finite = jnp.isfinite(global_root)  # finite leaves, even where the norm overflows float32
  zero = on_nonfinite == "zero"
  if mode == "per_tensor":
    scale, shift, keep, zero_fill = decide(leaf_norms, max_norm, zero, all_finite,
                                           leaf_roots, leaf_exps)
    clipped = jnp.any(~keep)
  else:
    scale, shift, keep, zero_fill = decide(global_norm, max_norm, zero, all_finite,
                                           global_root, global_exp)
    clipped = ~keep
  flags = jnp.stack([clipped, ~all_finite]).astype(jnp.int32)
  all_norms = jnp.concatenate([global_norm[None], leaf_norms])
  if not scale_leaves:
    return None, all_norms, flags
  if scale_fn is not None:
    return scale_fn(_pow2(shift), scale, keep, zero_fill, leaves), all_norms, flags
  if mode == "per_tensor":
    out = [scale_leaf(x, scale[i], keep[i], zero_fill, shift[i]) for i, x in enumerate(leaves)]
  else:
    out = [scale_leaf(x, scale, keep, zero_fill, shift) for x in leaves]
  return out, all_norms, flags


def andrea_clip(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_leaves: bool):
  """The clip of `leaves` in pure JAX; the custom call's contract."""
  max_norm = jnp.asarray(max_norm, _F32).reshape(())
  (root, exp), (leaf_roots, leaf_exps) = norms(leaves)
  return decide_and_scale(max_norm, leaves, root, exp, leaf_roots, leaf_exps, mode=mode,
                          on_nonfinite=on_nonfinite, scale_leaves=scale_leaves)
