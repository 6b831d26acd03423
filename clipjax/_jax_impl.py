"""Pure-JAX twin of the custom call (the path CPUs and TPUs take).

Same contract as `clipjax._ffi.andrea_clip`: returns `(out_leaves, norms,
flags)`. Squares are summed in float32; when that sum could have overflowed or
underflowed, the norm is recomputed on leaves rescaled by a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
# A float32 sum of squares at or above this (and finite) lost nothing that
# matters to underflow; below it, or when it is inf/NaN, rescale and redo.
_FAST_SUMSQ_MIN = 2.0**-60
_PRE_EXP = 64  # a subnormal scale factor is applied as 2**-64 times a normal one


def _as_f32(x):
  """x as float32 for the norm; a complex leaf as its real and imaginary parts (so that
  |z| above the float32 range does not overflow where its parts do not)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.stack([jnp.real(x), jnp.imag(x)]).astype(_F32)
  return x.astype(_F32)


def _pow2(k):
  """2.0**k as float32 for integer k, built from its bits; 0 below 2**-126."""
  k = jnp.asarray(k, jnp.int32)
  bits = (jnp.clip(k, -126, 127) + 127) << 23
  return jnp.where(k < -126, _F32(0), lax.bitcast_convert_type(bits, _F32))


def _exponent(amax):
  """e in [-126, 126] with amax * 2**-e below 4 and, for normal amax below
  2**126, at least 0.5 (so 2**-e is itself a normal float32)."""
  biased = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
  return jnp.where((biased == 0) | (biased == 0xFF), -126, jnp.minimum(biased - 126, 126))


def _unscale(v, e):
  """v * 2**e for e in [-252, 252], in two exact steps (2**e alone may not be a float32)."""
  return v * _pow2(e // 2) * _pow2(e - e // 2)


def _rescaled_norms(leaves32):
  """Per-leaf and global (root, exponent) pairs from leaves rescaled by powers of two.

  Each leaf is multiplied by 2**-e (e from its largest magnitude), so its
  squares neither overflow nor underflow where it matters; a norm is
  root * 2**e. Returns ((global root, global e), (leaf roots, leaf exponents)).
  """
  amax = jnp.stack([jnp.max(jnp.abs(x), initial=_F32(0)) for x in leaves32])
  exps = _exponent(amax)
  sums = jnp.stack([jnp.sum(jnp.square(x * _pow2(-exps[i]))) for i, x in enumerate(leaves32)])
  top = jnp.max(exps)
  total = jnp.sum(sums * _pow2(2 * (exps - top)))
  return (jnp.sqrt(total), top), (jnp.sqrt(sums), exps)


def _rescaled_global_norm(leaves32):
  """The global (root, exponent) from all leaves rescaled by one power of two.

  Only taken when the float32 sum of squares overflowed or underflowed, so
  it favours compile time over speed: the leaves are flattened into one vector
  and reduced by a handful of operations whatever their number.
  """
  flat = jnp.concatenate([x.reshape(-1) for x in leaves32])
  e = _exponent(jnp.max(jnp.abs(flat), initial=_F32(0)))
  return jnp.sqrt(jnp.sum(jnp.square(flat * _pow2(-e)))), e


def norms(leaves, *, per_leaf_exact: bool):
  """((global root, global exponent), (leaf roots, leaf exponents)).

  A norm is root * 2**exponent (`_unscale`); the root is finite whenever the
  leaves are, even where the norm itself is above the float32 range. With
  `per_leaf_exact` every leaf norm is computed rescaled (two passes per leaf);
  otherwise the per-leaf norms come from the fast float32 sums (exponent 0)
  and only the global norm is guaranteed against overflow and underflow.
  """
  leaves32 = [_as_f32(x) for x in leaves]
  if per_leaf_exact:
    return _rescaled_norms(leaves32)
  sums = jnp.stack([jnp.sum(jnp.square(x)) for x in leaves32])
  total = jnp.sum(sums)
  fast_ok = jnp.isfinite(total) & (total >= _FAST_SUMSQ_MIN)
  # The fast branch's exponent, 0, is computed from `total` so that inside shard_map
  # it varies over the same mesh axes as the other branch's.
  root, e = lax.cond(fast_ok, lambda xs: (jnp.sqrt(total), (total < 0).astype(jnp.int32)),
                     _rescaled_global_norm, leaves32)
  return (root, e), (jnp.sqrt(sums), jnp.zeros(len(leaves), jnp.int32))


def scale_leaf(x, scale, keep, zero_fill, pre):
  """x as the decision says: kept, zero-filled, or x * pre * scale (see `decide`)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    scaled = (x * pre.astype(x.dtype)) * scale.astype(x.dtype)
  else:
    scaled = ((x.astype(_F32) * pre) * scale).astype(x.dtype)
  out = jnp.where(keep, x, scaled)
  return jnp.where(zero_fill, jnp.zeros_like(x), out)


def decide(norm, max_norm, zero_nonfinite, all_finite, root, exp):
  """The clip decision of cuda/andrea_clip_common.h::DecideScale.

  Returns (scale, keep, zero_fill, pre): a clipped leaf becomes x * pre * scale.
  `norm` is root * 2**exp (inf where that is above float32). pre is 1 except where the
  factor max_norm / norm is subnormal or the norm is above the float32 range with
  a finite root (finite gradients): there the true factor max_norm / root *
  2**-exp is applied as 2**-64 times the rest, two normal float32 factors, since
  XLA flushes a subnormal factor to zero (the CPU handler splits it the same way).
  """
  keep = norm <= max_norm
  scale = max_norm / norm
  tiny = jnp.isinf(norm) | (jnp.abs(scale) < jnp.finfo(_F32).tiny)
  split = tiny & jnp.isfinite(root) & (root > 0)
  # 2**-64 then the rest: both normal for any float32 norm (exp <= 128 + log2 of the
  # element count) and any max_norm down to 2**-60 of the norm's subnormal limit.
  # max_norm is scaled up before the division: max_norm / root may itself be subnormal.
  scale = jnp.where(split, _unscale(max_norm, _PRE_EXP - exp) / root, scale)
  pre = jnp.where(split, _pow2(-_PRE_EXP), jnp.ones_like(norm))
  scale = jnp.where(keep, _F32(1), scale)
  zero_fill = jnp.logical_and(zero_nonfinite, jnp.logical_not(all_finite))
  return scale, keep & ~zero_fill, zero_fill, pre


def andrea_clip(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_leaves: bool):
  max_norm = jnp.asarray(max_norm, _F32).reshape(())
  per_tensor = mode == "per_tensor"
  (root, exp), (leaf_roots, leaf_exps) = norms(leaves, per_leaf_exact=per_tensor)
  global_norm, leaf_norms = _unscale(root, exp), _unscale(leaf_roots, leaf_exps)
  all_finite = jnp.isfinite(root)  # finite leaves, even where the norm overflows float32
  zero = on_nonfinite == "zero"
  if per_tensor:
    scale, keep, zero_fill, pre = decide(leaf_norms, max_norm, zero, all_finite, leaf_roots,
                                         leaf_exps)
    clipped = jnp.any(~keep)
  else:
    scale, keep, zero_fill, pre = decide(global_norm, max_norm, zero, all_finite, root, exp)
    clipped = ~keep
  flags = jnp.stack([clipped, ~all_finite]).astype(jnp.int32)
  all_norms = jnp.concatenate([global_norm[None], leaf_norms])
  if not scale_leaves:
    return None, all_norms, flags
  if per_tensor:
    out = [scale_leaf(x, scale[i], keep[i], zero_fill, pre[i]) for i, x in enumerate(leaves)]
  else:
    out = [scale_leaf(x, scale, keep, zero_fill, pre) for x in leaves]
  return out, all_norms, flags
