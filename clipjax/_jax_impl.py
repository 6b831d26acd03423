"""Pure-JAX twin of the custom call (the path CPUs and TPUs take), and the clip
decision that every path shares.

Same contract as `clipjax._ffi.clip_call`: returns `(out_leaves, norms, flags)`.

Only per-leaf reductions and elementwise ops touch the leaves, so XLA's SPMD
partitioner runs this on sharded gradients as it runs optax's clip: each device
reduces its own shards and an all-reduce combines a few floats per leaf. No leaf is
reshaped, concatenated or passed through a conditional (on GPUs, where each device's
leaves are its own, their small row sums are stacked: see `norms`).

Overflow and underflow are handled on scalars, not leaves. Every leaf yields three
sums of squares in one pass, of x, x * 2**-88 and x * 2**64 (in float32):

  mid   covers |x| in about [2**-63, 2**63]: used when it is finite and >= 2**-60;
  big   is finite for any finite leaf (below 2**47 elements): used when mid overflowed;
  small is exact for tiny leaves: used when mid < 2**-60 (every |x| < 2**-30).

A norm is kept as (root, exponent), norm = root * 2**exponent, so that a norm above
the float32 range still gives the right scale factor.

The arithmetic is float32, or float64 for a tree with a float64 (or complex128) leaf
(with jax_enable_x64): the same scheme, its exponents scaled to float64's range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


def norm_dtype(leaves):
  """The dtype of the norms and of the arithmetic: float64 for a tree with a float64 or
  complex128 leaf, else float32."""
  wide = any(jnp.dtype(x.dtype) in (jnp.dtype("float64"), jnp.dtype("complex128"))
             for x in leaves)
  return jnp.dtype("float64" if wide else "float32")


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


def _times_pow2(v, e):
  """v * 2**e, |e| up to twice the largest exponent, in two exact steps; linear in v."""
  real = jnp.finfo(v.dtype).dtype  # of a complex v, its parts' dtype
  return v * pow2(e // 2, real) * pow2(e - e // 2, real)


def _unscale(v, e):
  """`_times_pow2`, with NaN and inf kept as they are (inf * 2**-200 is inf, not inf * 0)."""
  return jnp.where(jnp.isfinite(v), _times_pow2(v, e), v)


def _real_parts(x, dtype):
  """The real arrays whose squares sum to |x|^2: x itself, or a complex leaf's parts
  (so that |z| above the float range does not overflow where its parts do not)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return [jnp.real(x).astype(dtype), jnp.imag(x).astype(dtype)]
  return [x.astype(dtype)]


def staged(values, dtype):
  """A vector of static numbers, made by traced ops rather than held as a constant array:
  the clip that `custom_partitioning` traces (`_partition._whole_call`) may hold no
  constants. XLA folds it into one."""
  return lax.concatenate([lax.broadcast_in_dim(np.asarray(v, dtype), (1,), ()) for v in values],
                         0)


def _factors(dtype):
  """The three scales (mid, big, small) as a vector of `dtype`, behind an optimization
  barrier: else XLA may rewrite (x * c)^2 as x^2 * c^2 and fold c^2, which is 0 or inf."""
  return lax.optimization_barrier(staged([2.0**k for k in _sum_exponents(dtype)], dtype))


def scaled_squares(x):
  """The squares of the real array x at the three scales (mid, big, small), stacked along
  a new leading axis, in x's dtype: what `pick_norm` picks from once they are summed."""
  return jnp.square(x[None] * _factors(x.dtype).reshape((3,) + (1,) * x.ndim))


def leaf_sums(x, dtype=_F32):
  """The leaf's three sums of squares (mid, big, small) as one array of 3, in `dtype`.

  One reduction: the leaf is broadcast against the three factors along a new leading
  axis and reduced over its own axes, so XLA reads it once (and partitions it like any
  per-leaf reduction: the leaf is neither reshaped nor copied).
  """
  sums = 0
  for part in _real_parts(x, dtype):
    sums = sums + jnp.sum(scaled_squares(part), axis=tuple(range(1, part.ndim + 1)))
  return sums


# A leaf's row sums are kept for up to this many rows (12 floats a row); a leaf of more
# rows, or a scalar, is summed whole.
_MAX_ROWS = 1 << 16


def row_sums(x, dtype=_F32):
  """The leaf's three sums of squares by its first axis, as three arrays (mid, big, small)
  of f[rows] in `dtype`: each row's (a vector's rows are its elements), or f[1], the whole
  leaf's, for a scalar or a leaf of more than _MAX_ROWS rows. One variadic reduction of the
  trailing axes reads the leaf once; the leaf broadcast against the factors, as `leaf_sums`
  reduces it, took XLA:GPU 1.5x as long (docs/wall_clock_analysis.md, "The row sums' form").
  """
  sums = None
  for part in _real_parts(x, dtype):
    if part.ndim and part.shape[0] <= _MAX_ROWS:
      factors = _factors(part.dtype)
      squares = tuple(jnp.square(part * factors[i]) for i in range(3))
      if part.ndim > 1:
        zero = jnp.zeros((), part.dtype)
        squares = lax.reduce(squares, (zero,) * 3,
                             lambda a, b: tuple(p + q for p, q in zip(a, b)),
                             tuple(range(1, part.ndim)))
      three = list(squares)
    else:
      three = list(leaf_sums(part, dtype).reshape(3, 1))
    sums = three if sums is None else [a + b for a, b in zip(sums, three)]
  return sums


# The platforms where the pure-JAX clip finishes the leaves' row sums together
# (`_sums_by_rows`): XLA:GPU otherwise finishes each large leaf's sums in a kernel of its
# own. Measured on CUDA only; on CPUs it is slower (docs/wall_clock_analysis.md, "The
# pure-JAX path's sums by rows").
ROW_SUM_PLATFORMS = ("cuda",)


def per_platform(by_rows, by_leaf, *args, **other_platforms):
  """by_rows(*args) where the program is lowered for one of ROW_SUM_PLATFORMS, by_leaf(*args)
  elsewhere, and other_platforms' own functions on theirs: decided when lowering
  (`lax.platform_dependent`), so a program lowered for another platform than the default
  backend, or for several, takes each platform's form."""
  return lax.platform_dependent(*args, default=by_leaf, **{
      **dict.fromkeys(ROW_SUM_PLATFORMS, by_rows), **other_platforms})


def _sums_by_leaf(leaves, dtype):
  """f[n, 3]: each leaf's three sums of squares, one reduction per leaf (see `norms`)."""
  return jnp.stack(lax.optimization_barrier([leaf_sums(x, dtype) for x in leaves]))


def _sums_by_rows(leaves, dtype):
  """f[n, 3]: each leaf's three sums of squares, from its row sums (`row_sums`): those of
  the same length are stacked and reduced in one op, so that XLA finishes them in a few
  kernels rather than in one or two per leaf (see `norms`)."""
  rows = lax.optimization_barrier([row_sums(x, dtype) for x in leaves])
  by_length: dict = {}
  for i, (mid, _, _) in enumerate(rows):
    by_length.setdefault(mid.shape[0], []).append(i)
  order = [i for members in by_length.values() for i in members]

  def finish(members):  # f[len(members), 3]; each leaf's three arrays stacked in one op
    stacked = jnp.stack([s for i in members for s in rows[i]])
    return jnp.sum(stacked.reshape(len(members), 3, -1), axis=2)

  # The second barrier keeps each length's reduction a kernel of its own: XLA:GPU may fuse
  # one into the permutation below, where one thread adds up a whole row (in the example's
  # 120M step, its embedding's 8449 row sums: 0.11-0.18 ms).
  sums = jnp.concatenate(lax.optimization_barrier(
      [finish(members) for members in by_length.values()]))
  return sums[staged(np.argsort(order), jnp.int32)]


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


def norms(leaves, *, by_rows: bool):
  """((global root, global exponent), (leaf roots, leaf exponents)); see the module doc.

  `by_rows`: each leaf is reduced to its row sums and those of the same length are
  finished together (`_sums_by_rows`), where XLA:GPU would otherwise finish each large
  leaf's sums in a kernel of its own (the example's 120M training step: 108 reduction
  kernels against 23). Only for leaves whole on the device that runs this: a sharded
  leaf's row sums are sharded too, and stacking them would move them between devices.
  Else each leaf is reduced whole (`_sums_by_leaf`), which XLA's partitioner splits like
  any reduction, all-reducing three sums per leaf.
  """
  (root, exp), (leaf_roots, leaf_exps) = _norms(by_rows, list(leaves))
  return (root, exp.astype(jnp.int32)), (leaf_roots, leaf_exps.astype(jnp.int32))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))  # derivative: `_norms_jvp`
def _norms(by_rows, leaves):
  """`norms`, the exponents as floats (whole numbers): their zero tangents are then made
  like any float's, as inside a `shard_map`, where they must vary as the exponents do."""
  dtype = norm_dtype(leaves)
  # The barrier (in either) keeps each leaf's reduction a fusion of its own, and whole:
  # stacked at once, XLA:GPU may fuse the reductions into the stack, where one thread
  # reduces a whole leaf.
  sums = (_sums_by_rows if by_rows else _sums_by_leaf)(leaves, dtype)
  per_leaf = [sums[:, j] for j in range(3)]
  # The three totals in one reduction. The barrier keeps it whole: else XLA:CPU turns the
  # sum of the stacked leaf sums into a chain of n scalar adds and copies that into the
  # fusion scaling each leaf (O(n^2) compile time).
  totals = jnp.sum(lax.optimization_barrier(sums), axis=0)
  return tuple((root, exp.astype(dtype)) for root, exp in (pick_norm(*totals),
                                                           pick_norm(*per_leaf)))


@_norms.defjvp
def _norms_jvp(by_rows, primals, tangents):
  """d|x| = <x, dx> / |x| for each norm, as d root = <x * 2**-e, dx * 2**-e> / root, which
  overflows nowhere the norm does not (the scaled sums, differentiated as computed, give
  NaN: an unused x * 2**64 may be inf, times its zero cotangent). Zero at a zero norm."""
  (leaves,), (dleaves,) = primals, tangents
  out = _norms(by_rows, leaves)
  (root, exp), (leaf_roots, leaf_exps) = out
  dtype = root.dtype
  exp, leaf_exps = exp.astype(jnp.int32), leaf_exps.astype(jnp.int32)

  def dot(x, dx, e):  # <x * 2**-e, dx * 2**-e>, linear in dx
    return sum(jnp.sum(_unscale(p, -e) * _times_pow2(q, -e))
               for p, q in zip(_real_parts(x, dtype), _real_parts(dx, dtype)))

  def over(v, r):  # v / r, 0 where r is 0
    return v * jnp.where(r == 0, 0, 1 / jnp.where(r == 0, 1, r))

  d_root = over(sum(dot(x, dx, exp) for x, dx in zip(leaves, dleaves)), root)
  d_leaves = over(jnp.stack([dot(x, dx, leaf_exps[i])
                             for i, (x, dx) in enumerate(zip(leaves, dleaves))]), leaf_roots)
  return out, ((d_root, jnp.zeros_like(out[0][1])), (d_leaves, jnp.zeros_like(out[1][1])))


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
  scale = jnp.where(finite, _unscale(r, a), max_norm / jnp.where(finite, 1, norm))
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
  # values as four arrays, XLA fused no two of AdamW's per-leaf updates (andrea-12m's
  # step: 557 kernels against 466).
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
