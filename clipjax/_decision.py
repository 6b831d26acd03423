"""The clip's arithmetic on norms, which every path shares: norms kept exact beyond the
float range, the decision they lead to, and the multiply that applies it in XLA.

- A norm is kept as (root, exponent), norm = root * 2**exponent, picked from sums of
  squares taken at three scales (`scaled_squares`, `pick_norm`), so that neither the
  squares nor the norm overflow or underflow (see `clipjax._backend.pure_jax`).
- `whole_norms`, `norm_of_norms`: norms of shards made whole over the mesh axes the
  shards are split on, and those norms' norm (the sharded clip's, after its norm calls).
- `from_norms`: the decision (`Decision`) from the global and per-leaf norms: keep the
  leaves, multiply them by max_norm / norm, or zero them on a non-finite norm under
  on_nonfinite="zero"; with the norms and flags that every clip returns.
- `scale_all`, `scale_by_rows`: the leaves multiplied as a decision says, with elementwise
  ops that XLA fuses into the leaves' consumers (the custom call's scale kernel is the
  other way, `clipjax._backend.ffi.scale_call`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


def _sum_exponents(dtype):
  """(k_mid, k_big, k_small): the exponents k of the factors 2**k applied before squaring,
  (0, -88, 64) in float32 and (0, -536, 512) in float64."""
  half = jnp.finfo(dtype).maxexp // 2
  return 0, -(half + 24), half


def _mid_sumsq_min(dtype):
  """mid at or above this (and finite) lost nothing that matters to underflow: in float32,
  2**-60, and an element whose square underflows adds below 2**-126, 2**-66 relative."""
  return 2.0**-(jnp.finfo(dtype).maxexp // 2 - 4)


def pow2(k, dtype=_F32):
  """2.0**k in `dtype` (float32 or float64) for integer k, built from its bits; 0 below
  the smallest normal."""
  fi = jnp.finfo(dtype)
  itype = jnp.int64 if fi.bits == 64 else jnp.int32
  k = jnp.asarray(k, itype)
  bits = (jnp.clip(k, fi.minexp, fi.maxexp - 1) - (fi.minexp - 1)) << fi.nmant
  return jnp.where(k < fi.minexp, jnp.zeros((), dtype), lax.bitcast_convert_type(bits, dtype))


def times_pow2(v, e):
  """v * 2**e, |e| up to twice the largest exponent, in two exact steps; linear in v."""
  real = jnp.finfo(v.dtype).dtype  # of a complex v, its parts' dtype
  return v * pow2(e // 2, real) * pow2(e - e // 2, real)


def unscale(v, e):
  """`times_pow2`, with NaN and inf kept as they are (inf * 2**-200 is inf, not inf * 0)."""
  return jnp.where(jnp.isfinite(v), times_pow2(v, e), v)


def staged(values, dtype):
  """A vector of static numbers, made by traced ops rather than held as a constant array:
  the clip that `custom_partitioning` traces (`clipjax._partitioning.spmd`) may hold no
  constants. XLA folds it into one."""
  return lax.concatenate([lax.broadcast_in_dim(np.asarray(v, dtype), (1,), ()) for v in values],
                         0)


def factors(dtype):
  """The three scales (mid, big, small) as a vector of `dtype`, behind an optimization
  barrier: else XLA may rewrite (x * c)^2 as x^2 * c^2 and fold c^2, which is 0 or inf."""
  return lax.optimization_barrier(staged([2.0**k for k in _sum_exponents(dtype)], dtype))


def scaled_squares(x):
  """The squares of the real array x at the three scales (mid, big, small), stacked along
  a new leading axis, in x's dtype: what `pick_norm` picks from once they are summed."""
  return jnp.square(x[None] * factors(x.dtype).reshape((3,) + (1,) * x.ndim))


def pick_norm(mid, big, small):
  """(root, exponent) of the norm from its three sums of squares, elementwise.

  The root is finite whenever the elements are (even where the norm overflows the float
  range), and NaN or inf where one is not.
  """
  _, k_big, k_small = _sum_exponents(mid.dtype)
  mid_min = _mid_sumsq_min(mid.dtype)
  use_mid = jnp.isfinite(mid) & (mid >= mid_min)
  use_small = mid < mid_min  # False for a NaN or inf mid
  root = jnp.sqrt(jnp.where(use_mid, mid, jnp.where(use_small, small, big)))
  exp = jnp.where(use_mid, 0, jnp.where(use_small, -k_small, -k_big))
  return root, exp.astype(jnp.int32)


def whole_norms(shard_norms, axes):
  """Whole norms from this device's norms of shards split over the mesh `axes`,
  elementwise, as (root, exponent) with norm = root * 2**exponent and the root in
  [0.5, 1), so that a whole norm above the float range is kept. NaN and inf carry through
  into the root. One all-reduce over `axes` of the shard norms' `scaled_squares`; none
  where `axes` is empty (the shards are whole)."""
  if not axes:
    return jnp.frexp(shard_norms)
  root, exponent = pick_norm(*lax.psum(scaled_squares(shard_norms), axes))
  mantissa, shift = jnp.frexp(root)
  return mantissa, exponent + shift


def norm_of_norms(roots, exps):
  """(root, exponent) of the norm of the norms roots_i * 2**exps_i."""
  top = jnp.max(jnp.where(jnp.isfinite(roots) & (roots > 0), exps, jnp.iinfo(jnp.int32).min))
  top = jnp.where(top == jnp.iinfo(jnp.int32).min, 0, top)
  aligned = roots * pow2(exps - top, roots.dtype)
  return jnp.sqrt(jnp.sum(jnp.square(aligned))), top


class Decision(NamedTuple):
  """What a clip does to its leaves, each field a scalar or one value per leaf: zeros where
  `zero_fill`, else the leaf unchanged where `keep`, else x * scale * 2**shift (`decide`)."""
  scale: object
  shift: object
  keep: object
  zero_fill: object


def decide(norm, max_norm, zero_nonfinite, all_finite, root, exp):
  """The clip decision, elementwise: cuda/andrea_clip_math.h::DecideScale's for every
  factor in float32's normal range; below it, the same factor split in two.

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
  lowest = jnp.finfo(root.dtype).minexp + 1  # -125 in float32
  normal = e >= lowest  # r * 2**e >= 2**-126 in float32
  # Below that, scale = r * 2**a with a in [-125, -1]: normal, and x * scale cannot overflow.
  a = jnp.where(normal, e, jnp.maximum(e + 1 - lowest, lowest))
  finite = jnp.isfinite(root) & (root > 0)
  # A finite norm is kept out of the division: its derivative is inf where norm**2 underflows.
  scale = jnp.where(finite, unscale(r, a), max_norm / jnp.where(finite, 1, norm))
  shift = jnp.where(finite & ~normal, e - a, 0)
  scale, shift = jnp.where(keep, jnp.ones_like(scale), scale), jnp.where(keep, 0, shift)
  zero_fill = jnp.logical_and(zero_nonfinite, jnp.logical_not(all_finite))
  return scale, shift.astype(jnp.int32), keep & ~zero_fill, zero_fill


def from_norms(max_norm, global_root, global_exp, leaf_roots, leaf_exps, *, mode: str,
               on_nonfinite: str):
  """The decision from the norms (as (root, exponent) pairs), by `mode` and `on_nonfinite`.

  Every path decides here: the pure-JAX clip, and the sharded clips after their all-reduce
  (the custom call decides in its kernel, `cuda/andrea_clip_math.h::DecideScale`, alike).

  Returns (Decision, norms f32[n + 1], flags int32[2]): the norms and flags as the custom
  call returns them.
  """
  global_norm, leaf_norms = unscale(global_root, global_exp), unscale(leaf_roots, leaf_exps)
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
  return Decision(scale, shift, keep, zero_fill), all_norms, flags


def multipliers(scale, shift, keep):
  """(scale, low, high): a decision's factor scale * 2**shift as three multipliers, with
  low * high = 2**shift in two powers of two that are floats themselves, and 1, 1, 1 for a
  kept leaf (x * 1 is x, bit for bit).

  With shift != 0 the factor is below the float range and scale < 1, so every element is
  finite (an inf or NaN one would have made the norm inf or NaN, and the factor 0 or NaN
  with shift 0): no product is inf * 0.
  """
  one = jnp.ones_like(scale)
  low = pow2(shift // 2, scale.dtype)
  return (jnp.where(keep, one, scale), jnp.where(keep, one, low),
          jnp.where(keep, one, pow2(shift - shift // 2, scale.dtype)))


def scale_leaf(x, scale, low, high, zero_fill):
  """x as the decision says: zeros where zero_fill, else ((x * scale) * low) * high, each
  product rounded to the arithmetic's float (see `multipliers`); XLA fuses these few
  elementwise ops into whatever consumes the leaf."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    scaled = x * scale.astype(x.dtype) * low.astype(x.dtype) * high.astype(x.dtype)
  else:
    scaled = ((x.astype(scale.dtype) * scale) * low * high).astype(x.dtype)
  return jnp.where(zero_fill, jnp.zeros_like(x), scaled)


def scale_by_rows(rows, leaves, *, per_leaf: bool):
  """Every leaf times its row of `rows`, f[n or 1, 4]: (scale, low, high, zero), as
  `multipliers` and the zero-fill flag make them and the custom call writes them
  (`Multipliers` in cuda/andrea_clip_math.h). Leaf i reads row i where `per_leaf`, else
  row 0. Each leaf's consumer reads one small array, whatever its row: XLA then still
  fuses the consumers of same-shape leaves into one kernel (AdamW's updates, for one),
  as it does for the optimizer alone."""
  def row(i):
    *factors, zero = (lax.squeeze(lax.slice(rows, (i, j), (i + 1, j + 1)), (0, 1))
                      for j in range(4))
    return (*factors, zero != 0)

  shared = None if per_leaf else row(0)  # traced once: the same ops for every leaf
  return [scale_leaf(x, *(row(i) if per_leaf else shared)) for i, x in enumerate(leaves)]


def scale_all(scale, shift, keep, zero_fill, leaves):
  """Every leaf by `scale_leaf`: XLA elementwise ops, which XLA fuses into the leaf's
  consumer. Each decision argument is a scalar, or one value per leaf."""
  scale, shift, keep, zero_fill = (jnp.asarray(v) for v in (scale, shift, keep, zero_fill))
  per_leaf = any(v.ndim for v in (scale, shift, keep, zero_fill))
  factors = multipliers(scale, shift, keep)
  columns = jnp.broadcast_arrays(*factors, zero_fill.astype(scale.dtype))
  # The barrier makes XLA compute the rows once, in a kernel of their own, rather than copy
  # their arithmetic into every consumer's fusion. One array, not four: with the four
  # values as four arrays, XLA fuses no two of AdamW's per-leaf updates (the kernels of
  # examples/benchmark.py --kernels show it).
  rows = lax.optimization_barrier(jnp.stack(columns, axis=-1).reshape(-1, 4))
  return scale_by_rows(rows, leaves, per_leaf=per_leaf)
