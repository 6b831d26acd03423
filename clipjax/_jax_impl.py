"""Pure-JAX twin of the custom call (the path CPUs and TPUs take), and the clip
decision that every path shares.

Same contract as `clipjax._ffi.clip_call`: returns `(out_leaves, norms, flags)`. The
norms, and how they stay exact at both ends of the range, are `clipjax._jax_norms`';
this module decides from them and scales the leaves, with elementwise ops that XLA
fuses into the leaves' consumers.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from clipjax._jax_norms import norm_dtype, norms, pow2, unscale

# The platforms where the pure-JAX clip finishes the leaves' row sums together
# (`_jax_norms._sums_by_rows`): XLA:GPU otherwise finishes each large leaf's sums in a kernel of its
# own. On CPUs it is slower (benchmarks/bench_pure_jax.py times both forms).
ROW_SUM_PLATFORMS = ("cuda",)


def per_platform(by_rows, by_leaf, *args, **other_platforms):
  """by_rows(*args) where the program is lowered for one of ROW_SUM_PLATFORMS, by_leaf(*args)
  elsewhere, and other_platforms' own functions on theirs: decided when lowering
  (`lax.platform_dependent`), so a program lowered for another platform than the default
  backend, or for several, takes each platform's form."""
  return lax.platform_dependent(*args, default=by_leaf, **{
      **dict.fromkeys(ROW_SUM_PLATFORMS, by_rows), **other_platforms})


def scale_leaf(x, scale, low, high, zero_fill):
  """x as the decision says: zeros where zero_fill, else ((x * scale) * low) * high, each
  product rounded to the arithmetic's float (see `multipliers`); XLA fuses these few
  elementwise ops into whatever consumes the leaf."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    scaled = x * scale.astype(x.dtype) * low.astype(x.dtype) * high.astype(x.dtype)
  else:
    scaled = ((x.astype(scale.dtype) * scale) * low * high).astype(x.dtype)
  return jnp.where(zero_fill, jnp.zeros_like(x), scaled)


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


def decide_and_scale(max_norm, leaves, global_root, global_exp, leaf_roots, leaf_exps, *,
                     mode: str, on_nonfinite: str, scale_leaves: bool, scale_fn=None):
  """The decision from the norms (as (root, exponent) pairs), then the scale.

  Every path ends here: the pure-JAX clip, and the sharded clips after their all-reduce.
  `scale_fn(scale, shift, keep, zero_fill, leaves)`, when given, scales the leaves by
  scale * 2**shift (the scale-only custom call); by default `scale_all` does, in XLA.

  Returns (out_leaves or None, norms f32[n + 1], flags int32[2]) as the custom call does.
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
  if not scale_leaves:
    return None, all_norms, flags
  scale_fn = scale_all if scale_fn is None else scale_fn
  return scale_fn(scale, shift, keep, zero_fill, leaves), all_norms, flags


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
  # values as four arrays, XLA fused no two of AdamW's per-leaf updates (the kernels of
  # benchmarks/bench_train_step.py --kernels show it).
  rows = lax.optimization_barrier(jnp.stack(columns, axis=-1).reshape(-1, 4))
  return scale_by_rows(rows, leaves, per_leaf=per_leaf)


def clip_leaves(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_leaves: bool,
                by_rows: bool | None):
  """The clip of `leaves` in pure JAX; the custom call's contract (norms in float64 for
  a tree with float64 leaves).

  `by_rows` as for `norms`, or None for leaves that are whole on the device that runs the
  clip (inside `shard_map`): each platform's form (`per_platform`).
  """
  if by_rows is None:
    def form(by_rows):
      return lambda max_norm, *leaves: clip_leaves(
          max_norm, list(leaves), mode=mode, on_nonfinite=on_nonfinite,
          scale_leaves=scale_leaves, by_rows=by_rows)

    return per_platform(form(True), form(False), max_norm, *leaves)
  max_norm = jnp.asarray(max_norm, norm_dtype(leaves)).reshape(())
  (root, exp), (leaf_roots, leaf_exps) = norms(leaves, by_rows=by_rows)
  return decide_and_scale(max_norm, leaves, root, exp, leaf_roots, leaf_exps, mode=mode,
                          on_nonfinite=on_nonfinite, scale_leaves=scale_leaves)
