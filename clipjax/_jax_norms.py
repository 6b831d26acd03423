"""The pure-JAX clip's norms: range-safe sums of squares of the leaves, by leaf or by rows,
and their derivative (`clipjax._jax_impl` takes the decision and scales).

Only per-leaf reductions and elementwise ops touch the leaves, so XLA's SPMD
partitioner runs these on sharded gradients as it runs optax's norm: each device
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


def unscale(v, e):
  """`_times_pow2`, with NaN and inf kept as they are (inf * 2**-200 is inf, not inf * 0)."""
  return jnp.where(jnp.isfinite(v), _times_pow2(v, e), v)


def _real_parts(x, dtype):
  """The real arrays whose squares sum to |x|^2: x itself, or a complex leaf's parts
  (so that |z| above the float range does not overflow where its parts do not)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return [jnp.real(x).astype(dtype), jnp.imag(x).astype(dtype)]
  return [jnp.asarray(x, dtype)]  # also a Python number leaf, as jax.grad passes it


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
  reduces it, is slower on XLA:GPU (benchmarks/bench_pure_jax.py).
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
  # one into the permutation below, where one thread adds up a whole row (an embedding's
  # row sums, in the example's step: benchmarks/bench_pure_jax.py).
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
  leaf's sums in a kernel of its own (benchmarks/bench_pure_jax.py counts the kernels). Only for leaves whole on the device that runs this: a sharded
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
    return sum(jnp.sum(unscale(p, -e) * _times_pow2(q, -e))
               for p, q in zip(_real_parts(x, dtype), _real_parts(dx, dtype)))

  def over(v, r):  # v / r, 0 where r is 0
    return v * jnp.where(r == 0, 0, 1 / jnp.where(r == 0, 1, r))

  dots = jnp.stack([dot(x, dx, leaf_exps[i]) for i, (x, dx) in enumerate(zip(leaves, dleaves))])
  d_leaves = over(dots, leaf_roots)
  # The same dots at the global exponent, which is at least each leaf's (the global norm
  # is the larger): one read of each leaf, and one sum rather than a chain of n adds.
  d_root = over(jnp.sum(_times_pow2(dots, 2 * (leaf_exps - exp))), root)
  return out, ((d_root, jnp.zeros_like(out[0][1])), (d_leaves, jnp.zeros_like(out[1][1])))
