"""A seeded differential fuzz of both paths against a float64 NumPy reference.

Random trees mix dtypes (float32, bfloat16, float16), sizes around the custom call's chunk
(0, 1, 32767, 32768, 32769, ...) and magnitudes from 1e-37 to 1e38 (float16 within its
range), with NaN or inf now and then. max_norm runs from 1e-30 to 1e30, as a Python float
(a constant of the jit) or traced. Checked on each tree: the norm, the decision, the
non-finite flag, the output dtypes, unclipped leaves bit for bit, and clipped leaves within
one ulp of their dtype of the float64 product.

Twenty-five cases per path run by default, 175 more with the slow set (`-m slow`);
`pytest -m fuzz tests/test_fuzz.py` runs thousands.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import clipjax

SIZES = (0, 1, 2, 3, 7, 100, 32767, 32768, 32769)
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)
MAGNITUDE = {np.float32: (-37, 38), ml_dtypes.bfloat16: (-37, 38), np.float16: (-4, 4)}


def _tree(rng):
  leaves = []
  for _ in range(rng.integers(1, 6)):
    dtype = DTYPES[rng.integers(len(DTYPES))]
    lo, hi = MAGNITUDE[dtype]
    size = int(SIZES[rng.integers(len(SIZES))] if rng.random() < 0.7 else rng.integers(1, 3000))
    scale = 10.0 ** rng.uniform(lo, hi)
    # |x| in [scale, 2 scale): every element a normal number of its dtype.
    x = scale * (1 + rng.random(size)) * rng.choice([-1.0, 1.0], size)
    if size and rng.random() < 0.05:
      x[rng.integers(size)] = rng.choice([np.nan, np.inf, -np.inf])
    leaves.append(x.astype(dtype))
  return leaves


def _ulp(values, dtype):
  finfo = ml_dtypes.finfo(dtype)
  exponent = np.floor(np.log2(np.maximum(np.abs(values), float(finfo.tiny))))
  return np.exp2(exponent - finfo.nmant)


def _check_case(seed, impl):
  rng = np.random.default_rng(seed)
  leaves = _tree(rng)
  max_norm = float(np.float32(10.0 ** rng.uniform(-30, 30)))
  traced = rng.random() < 0.5
  on_nonfinite = "zero" if rng.random() < 0.5 else "propagate"
  as64 = [x.astype(np.float64) for x in leaves]
  finite = all(np.all(np.isfinite(x)) for x in as64)
  norm64 = float(np.sqrt(sum(np.sum(x * x) for x in as64))) if finite else None

  tree = [jnp.asarray(x) for x in leaves]
  clip = lambda t, m: clipjax.clip_tree(t, m, impl=impl, on_nonfinite=on_nonfinite)
  # A traced max_norm is an argument of the jit; a Python float is a constant of it, as in
  # a training step that clips by `andrea_clip(1.0)`.
  if traced:
    result = jax.jit(clip)(tree, jnp.float32(max_norm))
  else:
    result = jax.jit(clip, static_argnums=1)(tree, max_norm)
  where = f"seed {seed}, impl {impl}, max_norm {max_norm:g}"
  for got, x in zip(result.updates, leaves):
    assert got.dtype == x.dtype, where
  assert bool(result.nonfinite) == (not finite), where
  if not finite:
    if on_nonfinite == "zero":
      for got in result.updates:
        assert not np.any(np.asarray(got, np.float64)), where
    return

  norm32 = float(result.global_norm)
  if norm64 > float(np.finfo(np.float32).max):
    assert norm32 == np.inf, where
  else:
    np.testing.assert_allclose(norm32, norm64, rtol=2e-6, err_msg=where)
  if abs(norm64 / max_norm - 1) < 1e-5:
    return  # too close to call in float32
  assert bool(result.clipped) == (norm64 > max_norm), where
  for got, x, x64 in zip(result.updates, leaves, as64):
    got = np.asarray(got)
    if not result.clipped:
      np.testing.assert_array_equal(got.view(np.uint8), x.view(np.uint8), err_msg=where)
      continue
    want = x64 * (max_norm / norm64)
    tiny = float(ml_dtypes.finfo(x.dtype).tiny)
    err = np.abs(got.astype(np.float64) - want)
    # One ulp of the dtype, plus float32's rounding of the norm and the factor (a few
    # parts in 2**24) for float32 leaves; values below the normal range may flush to 0.
    tol = _ulp(want, x.dtype) + 4e-7 * np.abs(want) + (np.abs(want) < tiny) * tiny
    assert np.all(err <= tol), (where, float(np.max(err / tol)))


CASES_PER_BLOCK = 25  # block 0 by default, blocks 1-7 in the slow set


@pytest.mark.parametrize("impl", ["jax", "ffi"])
@pytest.mark.parametrize("block", [0, *(pytest.param(b, marks=pytest.mark.slow)
                                       for b in range(1, 8))])
def test_fuzz_against_float64(impl, block):
  for seed in range(block * CASES_PER_BLOCK, (block + 1) * CASES_PER_BLOCK):
    _check_case(seed, impl)


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", ["jax", "ffi"])
@pytest.mark.parametrize("block", range(40))
def test_fuzz_against_float64_long(impl, block):
  for seed in range(10_000 + block * 100, 10_000 + block * 100 + 100):
    _check_case(seed, impl)
