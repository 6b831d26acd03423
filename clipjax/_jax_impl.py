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


def _as_f32(x):
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.abs(x).astype(_F32)
  return x.astype(_F32)


def _mul_pow2(x, k):
  """x * 2**k for integer k in [-300, 300] without overflowing 2**k itself."""
  a = k // 2
  return x * jnp.ldexp(_F32(1), a) * jnp.ldexp(_F32(1), k - a)


def _leaf_exponent(x32):
  """e with max|x| * 2**-e in [0.5, 1); 0 for an all-zero or empty leaf."""
  amax = jnp.max(jnp.abs(x32), initial=_F32(0)) if x32.size else _F32(0)
  _, e = jnp.frexp(amax)
  return jnp.where(jnp.isfinite(amax), e, 0).astype(jnp.int32), amax


def _rescaled_norms(leaves32):
  """Per-leaf and global norms from leaves rescaled by powers of two."""
  exps = [_leaf_exponent(x)[0] for x in leaves32]
  sums = [jnp.sum(jnp.square(_mul_pow2(x, -e))) for x, e in zip(leaves32, exps)]
  leaf_norms = [_mul_pow2(jnp.sqrt(s), e) for s, e in zip(sums, exps)]
  top = jnp.max(jnp.stack(exps))
  total = sum(s * _mul_pow2(_F32(1), 2 * (e - top)) for s, e in zip(sums, exps))
  return _mul_pow2(jnp.sqrt(total), top), jnp.stack(leaf_norms)


def _fast_norms(leaves32):
  sums = jnp.stack([jnp.sum(jnp.square(x)) for x in leaves32])
  return jnp.sqrt(jnp.sum(sums)), jnp.sqrt(sums)


def norms(leaves, *, per_leaf_exact: bool):
  """(global norm, per-leaf norms), both float32.

  With `per_leaf_exact` every leaf norm is computed rescaled (two passes per
  leaf); otherwise the per-leaf norms come from the fast float32 sums and only
  the global norm is guaranteed against overflow and underflow.
  """
  leaves32 = [_as_f32(x) for x in leaves]
  if per_leaf_exact:
    return _rescaled_norms(leaves32)
  sums = jnp.stack([jnp.sum(jnp.square(x)) for x in leaves32])
  total = jnp.sum(sums)
  fast_ok = jnp.isfinite(total) & (total >= _FAST_SUMSQ_MIN)
  return lax.cond(fast_ok, lambda xs: (jnp.sqrt(total), jnp.sqrt(sums)), _rescaled_norms,
                  leaves32)


def _scale_leaf(x, scale, keep, zero_fill):
  scaled = (_as_f32(x) * scale).astype(x.dtype) if not jnp.issubdtype(
      x.dtype, jnp.complexfloating) else (x * scale.astype(x.dtype))
  out = jnp.where(keep, x, scaled)
  return jnp.where(zero_fill, jnp.zeros_like(x), out)


def decide(norm, max_norm, zero_nonfinite, all_finite):
  """The clip decision of cuda/andrea_clip_common.h::DecideScale."""
  keep = norm <= max_norm
  scale = jnp.where(keep, _F32(1), max_norm / norm)
  zero_fill = jnp.logical_and(zero_nonfinite, jnp.logical_not(all_finite))
  return scale, keep & ~zero_fill, zero_fill


def andrea_clip(max_norm, leaves, *, mode: str, on_nonfinite: str, scale_leaves: bool):
  max_norm = jnp.asarray(max_norm, _F32).reshape(())
  per_tensor = mode == "per_tensor"
  global_norm, leaf_norms = norms(leaves, per_leaf_exact=per_tensor)
  all_finite = jnp.isfinite(global_norm)
  zero = on_nonfinite == "zero"
  if per_tensor:
    scale, keep, zero_fill = decide(leaf_norms, max_norm, zero, all_finite)
    clipped = jnp.any(~keep)
  else:
    scale, keep, zero_fill = decide(global_norm, max_norm, zero, all_finite)
    clipped = ~keep
  flags = jnp.stack([clipped, ~all_finite]).astype(jnp.int32)
  all_norms = jnp.concatenate([global_norm[None], leaf_norms])
  if not scale_leaves:
    return None, all_norms, flags
  if per_tensor:
    out = [_scale_leaf(x, scale[i], keep[i], zero_fill) for i, x in enumerate(leaves)]
  else:
    out = [_scale_leaf(x, scale, keep, zero_fill) for x in leaves]
  return out, all_norms, flags
