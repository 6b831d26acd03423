"""The scale-only custom call (`clipjax_andrea_scale`) that the sharded clip runs after its
all-reduce, against its contract: x times scale * 2**shift, rounded to the leaf's dtype (a
float32 multiply for a normal factor, float64 and one rounding below that), or the leaf
kept, or zeros. It runs on the default backend: the CPU handler here,
the CUDA kernels on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clipjax import _native
from clipjax._backend import ffi as _ffi

F32 = jnp.float32
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")


def _leaves(seed=0):
  """Mixed dtypes, odd and multi-chunk sizes, a misaligned view-like size, an empty leaf."""
  rng = np.random.default_rng(seed)
  shapes = [(3, 5), (40_000,), (1,), (0,), (70_001,), (8, 8)]
  return [jnp.asarray(rng.standard_normal(s) * 3, DTYPES[i % 3]) for i, s in enumerate(shapes)]


def _reference(leaves, scale, shift, keep, zero_fill):
  """For a normal factor (shift 0): the float32 product, bit for bit."""
  n = len(leaves)
  at = lambda v, i: jnp.broadcast_to(jnp.asarray(v), (n,))[i]  # noqa: E731

  def one(x, scale, shift, keep, zero_fill):
    scaled = (x.astype(F32) * (scale * 2.0**shift)).astype(x.dtype)
    return jnp.where(zero_fill, jnp.zeros_like(x), jnp.where(keep, x, scaled))
  return [one(x, at(scale, i).astype(F32), at(shift, i).astype(F32), at(keep, i),
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
  scale, shift, keep, zero = {
      "global": (F32(0.37), 0, False, False),
      "per_leaf": (jnp.linspace(0.1, 0.9, n, dtype=F32), jnp.arange(n) % 2 - 3,
                   jnp.arange(n) % 3 == 1, False),
      "keep_all": (F32(1), 0, True, False),
      "zero_fill": (F32(0.37), 0, False, True),
  }[case]
  got = jax.jit(_ffi.scale_call)(scale, shift, keep, zero, leaves)
  want = _reference(leaves, scale, shift, keep, zero)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                  err_msg=f"leaf {i} ({g.dtype})")


@pytest.mark.parametrize("shift", [-130, -200, -260])
def test_a_factor_below_float32s_range_is_applied_in_float64(shift):
  # scale * 2**shift is far below float32's normal range: as one float32 it would be 0, or
  # flushed by XLA. Leaves of 2**120 to 2**128 bring the results back up (to normal floats
  # for shifts -130 and -200), and each must be the float64 product rounded once. At -260
  # they are subnormal: exact on a GPU, flushed to zero on the CPU.
  rng = np.random.default_rng(1)
  leaves = [jnp.asarray(rng.uniform(1, 2, n) * 2.0**rng.integers(120, 127, n), F32)
            for n in (5, 40_000)]
  got = jax.jit(_ffi.scale_call)(F32(1.25), shift, False, False, leaves)
  for g, x in zip(got, leaves):
    want = (np.asarray(x, np.float64) * (1.25 * 2.0**shift)).astype(np.float32)
    g = np.asarray(g)
    if shift >= -200:
      np.testing.assert_array_equal(g, want)
    else:
      assert np.all((g == want) | ((g == 0) & (want < np.finfo(np.float32).tiny)))
      assert np.any(want > 0)


def test_donated_leaves_are_scaled_in_place():
  leaves = _leaves()
  expected = _reference(leaves, F32(0.5), 0, False, False)
  copies = [jnp.array(x) for x in leaves]
  fn = jax.jit(lambda ls: _ffi.scale_call(F32(0.5), 0, False, False, ls),
               donate_argnums=0)
  hlo = fn.lower(copies).compile().as_text()
  assert hlo.count('custom_call_target="clipjax_andrea_scale"') == 1
  got = fn(copies)
  for g, w in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_nan_and_inf_pass_through_a_multiply_and_vanish_in_a_zero_fill():
  x = jnp.asarray([1.0, np.nan, np.inf, -np.inf], F32)
  scaled = _ffi.scale_call(F32(0.5), 0, False, False, [x])[0]
  np.testing.assert_array_equal(np.asarray(scaled), [0.5, np.nan, np.inf, -np.inf])
  zeroed = _ffi.scale_call(F32(0.5), 0, False, True, [x])[0]
  np.testing.assert_array_equal(np.asarray(zeroed), np.zeros(4, np.float32))


def test_no_leaves():
  assert _ffi.scale_call(F32(0.5), 0, False, False, []) == []


def test_the_call_constrains_no_layout():
  """XLA copies every aliased operand of a custom call that constrains its layouts before
  it assigns layouts, and removes the copies only passes later (20,000 of them, each
  walked by those passes, at 20,000 leaves). The scale call constrains none: its kernel is
  elementwise, so any layout of a leaf is right, and its other operands have one
  dimension."""
  leaves = [jnp.full((2, 40 + i), i, F32) for i in range(_ffi.MAX_LEAVES_PER_CALL + 3)]
  fn = jax.jit(lambda ls: _ffi.scale_call(F32(0.5), 0, False, False, ls), donate_argnums=0)
  lowered = fn.lower(leaves)
  calls = [line for line in lowered.as_text().splitlines() if "@clipjax_andrea_scale" in line]
  assert len(calls) == 2
  assert not any("operand_layouts" in line or "result_layouts" in line for line in calls)
  assert all("output_operand_aliases" in line for line in calls)
  compiled = [line for line in lowered.compile().as_text().splitlines()
              if 'custom_call_target="clipjax_andrea_scale"' in line]
  assert len(compiled) == 2 and not any("operand_layout_constraints" in c for c in compiled)
  for i, got in enumerate(fn(leaves)):
    np.testing.assert_array_equal(np.asarray(got), np.full((2, 40 + i), 0.5 * i, np.float32))
