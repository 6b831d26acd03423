"""The pure-JAX clip (the path CPUs and TPUs take): range-safe sums of squares of the
leaves, by leaf or by rows, their derivative, and the clip they lead to (`clip_leaves`:
the decision and the multiply are `clipjax._decision`'s, which every path shares).

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

from clipjax import _decision
from clipjax._tree import norm_dtype

_F32 = jnp.float32

# The platforms where the pure-JAX clip finishes the leaves' row sums together
# (`_sums_by_rows`): XLA:GPU otherwise finishes each large leaf's sums in a kernel of its
# own. On CPUs it is slower (benchmarks/bench_pure_jax.py times both forms).
ROW_SUM_PLATFORMS = ("cuda",)


def per_platform(by_rows, by_leaf, *args, **other_platforms):
  """by_rows(*args) where the program is lowered for one of ROW_SUM_PLATFORMS, by_leaf(*args)
  elsewhere, and other_platforms' own functions on theirs: decided when lowering
  (`lax.platform_dependent`), so a program lowered for another platform than the default
  backend, or for several, takes each platform's form."""
  return lax.platform_dependent(*args, default=by_leaf, **{
      **dict.fromkeys(ROW_SUM_PLATFORMS, by_rows), **other_platforms})


def _real_parts(x, dtype):
  """The real arrays whose squares sum to |x|^2: x itself, or a complex leaf's parts
  (so that |z| above the float range does not overflow where its parts do not)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return [jnp.real(x).astype(dtype), jnp.imag(x).astype(dtype)]
  return [jnp.asarray(x, dtype)]  # also a Python number leaf, as jax.grad passes it


def leaf_sums(x, dtype=_F32):
  """The leaf's three sums of squares (mid, big, small) as one array of 3, in `dtype`.

  One reduction: the leaf is broadcast against the three factors along a new leading
  axis and reduced over its own axes, so XLA reads it once (and partitions it like any
  per-leaf reduction: the leaf is neither reshaped nor copied).
  """
  sums = 0
  for part in _real_parts(x, dtype):
    squares = _decision.scaled_squares(part)
    sums = sums + jnp.sum(squares, axis=tuple(range(1, part.ndim + 1)))
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
      factors = _decision.factors(part.dtype)
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
  return sums[_decision.staged(np.argsort(order), jnp.int32)]


def norms(leaves, *, by_rows: bool):
  """((global root, global exponent), (leaf roots, leaf exponents)); see the module doc.

  `by_rows`: each leaf is reduced to its row sums and those of the same length are
  finished together (`_sums_by_rows`), where XLA:GPU would otherwise finish each large
  leaf's sums in a kernel of its own (benchmarks/bench_pure_jax.py counts the kernels).
  Only for leaves whole on the device that runs this: a sharded leaf's row sums are
  sharded too, and stacking them would move them between devices.
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
  picked = (_decision.pick_norm(*totals), _decision.pick_norm(*per_leaf))
  return tuple((root, exp.astype(dtype)) for root, exp in picked)


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
    return sum(jnp.sum(_decision.unscale(p, -e) * _decision.times_pow2(q, -e))
               for p, q in zip(_real_parts(x, dtype), _real_parts(dx, dtype)))

  def over(v, r):  # v / r, 0 where r is 0
    return v * jnp.where(r == 0, 0, 1 / jnp.where(r == 0, 1, r))

  dots = jnp.stack([dot(x, dx, leaf_exps[i]) for i, (x, dx) in enumerate(zip(leaves, dleaves))])
  d_leaves = over(dots, leaf_roots)
  # The same dots at the global exponent, which is at least each leaf's (the global norm
  # is the larger): one read of each leaf, and one sum rather than a chain of n adds.
  d_root = over(jnp.sum(_decision.times_pow2(dots, 2 * (leaf_exps - exp))), root)
  return out, ((d_root, jnp.zeros_like(out[0][1])), (d_leaves, jnp.zeros_like(out[1][1])))


def clip_leaves(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_leaves: bool,
                by_rows: bool | None):
  """The clip of `leaves` in pure JAX; the custom call's contract (`ffi.clip_call`), with
  norms in float64 for a tree with float64 leaves.

  `by_rows` as for `norms`, or None for leaves that are whole on the device that runs the
  clip (inside `shard_map`): each platform's form (`per_platform`).

  Returns (out_leaves or None, norms f[n + 1], flags int32[2]).
  """
  if by_rows is None:
    def form(by_rows):
      return lambda max_norm, *leaves: clip_leaves(
          max_norm, list(leaves), mode=mode, on_nonfinite=on_nonfinite,
          scale_leaves=scale_leaves, by_rows=by_rows)

    return per_platform(form(True), form(False), max_norm, *leaves)
  (root, exp), (leaf_roots, leaf_exps) = norms(leaves, by_rows=by_rows)
  max_norm = jnp.asarray(max_norm, root.dtype).reshape(())  # the norms' dtype, `norm_dtype`
  decision, all_norms, flags = _decision.from_norms(max_norm, root, exp, leaf_roots, leaf_exps,
                                                    mode=mode, on_nonfinite=on_nonfinite)
  return (_decision.scale_all(*decision, leaves) if scale_leaves else None), all_norms, flags
