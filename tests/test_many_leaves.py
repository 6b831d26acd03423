"""A tree of more leaves than one custom call takes (`_ffi.MAX_LEAVES_PER_CALL`): norm
calls and scale calls of that many leaves each, with the decision between them. Same
contract as one call: the norm of the whole tree, one decision, every leaf scaled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from clipjax import _ffi, _native
from conftest import f64_norm

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")

N = 2 * _ffi.MAX_LEAVES_PER_CALL + 3  # three calls' worth


def _tree(seed=0):
  rng = np.random.default_rng(seed)
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  return {f"p{i:04d}": jnp.asarray(rng.standard_normal(int(rng.integers(0, 40))),
                                   dtypes[i % 3]) for i in range(N)}


def _custom_calls(fn, *args):
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return (hlo.count('custom_call_target="clipjax_andrea_clip"'),
          hlo.count('custom_call_target="clipjax_andrea_scale"'))


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
def test_matches_float64_and_the_pure_jax_path(mode):
  tree = _tree()
  got = clipjax.clip_tree(tree, 1.0, impl="ffi", mode=mode)
  ref = clipjax.clip_tree(tree, 1.0, impl="jax", mode=mode)
  np.testing.assert_allclose(float(got.global_norm), f64_norm(tree), rtol=1e-6)
  assert bool(got.clipped) and bool(ref.clipped)
  for k in tree:
    g, r = np.asarray(got.updates[k], np.float64), np.asarray(ref.updates[k], np.float64)
    eps = float(jnp.finfo(tree[k].dtype).eps)
    np.testing.assert_allclose(g, r, rtol=2 * eps, atol=1e-7, err_msg=k)
  leaf_norms = np.asarray(got.leaf_norms, np.float64)
  want = [f64_norm({k: v}) for k, v in tree.items()]
  np.testing.assert_allclose(leaf_norms, want, rtol=1e-6)


def test_is_clipped_by_three_norm_calls_and_three_scale_calls():
  tree = _tree()
  assert _custom_calls(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates, tree) == (3, 3)
  assert _custom_calls(lambda t: clipjax.global_norm(t, impl="ffi"), tree) == (3, 0)


def test_below_max_norm_is_bit_identical_and_nan_zeroes_every_leaf():
  tree = _tree(1)
  out = clipjax.clip_tree(tree, 1e6, impl="ffi")
  assert not bool(out.clipped)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out.updates[k]).view(np.uint8),
                                  np.asarray(tree[k]).view(np.uint8))
  tree["p0007"] = tree["p0007"].at[0].set(jnp.nan)
  zeroed = clipjax.clip_tree(tree, 1.0, impl="ffi", on_nonfinite="zero")
  assert bool(zeroed.nonfinite)
  assert all(not np.any(np.asarray(v, np.float32)) for v in zeroed.updates.values())
