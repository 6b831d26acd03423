"""The scale-only custom call (`clipjax_andrea_scale`) that the sharded clip runs after its
all-reduce, against its contract computed in JAX: (x * pre) * scale, rounded to the leaf's
dtype, or the leaf kept, or zeros. It runs on the default backend: the CPU handler here,
the CUDA kernels on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clipjax import _ffi

F32 = jnp.float32
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

pytestmark = pytest.mark.skipif(not _ffi.platforms(), reason="no clipjax custom-call handler")


def _leaves(seed=0):
  """Mixed dtypes, odd and multi-chunk sizes, a misaligned view-like size, an empty leaf."""
  rng = np.random.default_rng(seed)
  shapes = [(3, 5), (40_000,), (1,), (0,), (70_001,), (8, 8)]
  return [jnp.asarray(rng.standard_normal(s) * 3, DTYPES[i % 3]) for i, s in enumerate(shapes)]


def _reference(leaves, scale, pre, keep, zero_fill):
  n = len(leaves)
  at = lambda v, i: jnp.broadcast_to(jnp.asarray(v), (n,))[i]  # noqa: E731

  def one(x, scale, pre, keep, zero_fill):
    scaled = ((x.astype(F32) * pre) * scale).astype(x.dtype)
    return jnp.where(zero_fill, jnp.zeros_like(x), jnp.where(keep, x, scaled))
  return [one(x, at(scale, i).astype(F32), at(pre, i).astype(F32), at(keep, i),
              at(zero_fill, i)) for i, x in enumerate(leaves)]


def _ulps(got, want):
  """Largest difference in units of the leaf type's epsilon, relative to |want|."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  eps = float(jnp.finfo(got.dtype).eps)
  scale = np.maximum(np.abs(w), float(jnp.finfo(got.dtype).tiny))
  return float(np.max(np.abs(g - w) / scale / eps, initial=0.0))


@pytest.mark.parametrize("case", ["global", "per_leaf", "keep_all", "zero_fill"])
def test_matches_the_pure_jax_scale_bit_for_bit(case):
  leaves = _leaves()
  n = len(leaves)
  scale, pre, keep, zero = {
      "global": (F32(0.37), F32(1), False, False),
      "per_leaf": (jnp.linspace(0.1, 0.9, n, dtype=F32), jnp.ones(n, F32),
                   jnp.arange(n) % 3 == 1, False),
      "keep_all": (F32(1), F32(1), True, False),
      "zero_fill": (F32(0.37), F32(1), False, True),
  }[case]
  got = jax.jit(_ffi.andrea_scale)(scale, pre, keep, zero, leaves)
  want = _reference(leaves, scale, pre, keep, zero)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                  err_msg=f"leaf {i} ({g.dtype})")


def test_a_split_subnormal_factor_is_applied_within_one_ulp():
  # The factor 2**-64 * 2**-70 is far below the float32 normal range: a single float32
  # factor would be flushed to zero by XLA. Leaves of 2**120 bring the result back up.
  leaves = [jnp.asarray(np.random.default_rng(1).uniform(1, 2, n) * 2.0**120, F32)
            for n in (5, 40_000)]
  scale, pre = F32(2.0**-70 * 1.25), F32(2.0**-64)
  got = jax.jit(_ffi.andrea_scale)(scale, pre, False, False, leaves)
  want = _reference(leaves, scale, pre, False, False)
  for g, w in zip(got, want):
    assert np.all(np.asarray(w) > 0)
    assert _ulps(g, w) <= 1.0


def test_donated_leaves_are_scaled_in_place():
  leaves = _leaves()
  expected = _reference(leaves, F32(0.5), F32(1), False, False)
  copies = [jnp.array(x) for x in leaves]
  fn = jax.jit(lambda ls: _ffi.andrea_scale(F32(0.5), F32(1), False, False, ls),
               donate_argnums=0)
  hlo = fn.lower(copies).compile().as_text()
  assert hlo.count('custom_call_target="clipjax_andrea_scale"') == 1
  got = fn(copies)
  for g, w in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_nan_and_inf_pass_through_a_multiply_and_vanish_in_a_zero_fill():
  x = jnp.asarray([1.0, np.nan, np.inf, -np.inf], F32)
  scaled = _ffi.andrea_scale(F32(0.5), F32(1), False, False, [x])[0]
  np.testing.assert_array_equal(np.asarray(scaled), [0.5, np.nan, np.inf, -np.inf])
  zeroed = _ffi.andrea_scale(F32(0.5), F32(1), False, True, [x])[0]
  np.testing.assert_array_equal(np.asarray(zeroed), np.zeros(4, np.float32))


def test_no_leaves():
  assert _ffi.andrea_scale(F32(0.5), F32(1), False, False, []) == []
