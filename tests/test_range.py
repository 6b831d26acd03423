"""Scale factors and norms at the ends of float32's range, on both paths."""

import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from conftest import f64_norm


CUSTOM_CALL_SPLIT = pytest.mark.xfail(
    strict=True, reason="the custom call's decision (cuda/andrea_clip_common.h) still applies "
    "a factor below 2**-126 as 2**-64 times the rest, so it flushes below about 2**-190")


@pytest.mark.parametrize("impl", ["jax", pytest.param("ffi", marks=CUSTOM_CALL_SPLIT)])
@pytest.mark.parametrize("x, max_norm", [(1e28, 1e-30), (3e38, 1e-20), (1e25, 1e-35)])
def test_a_factor_far_below_float32s_range_is_applied_exactly(impl, x, max_norm):
  out = clipjax.clip_tree({"w": jnp.array([x], jnp.float32)}, max_norm, impl=impl)
  np.testing.assert_allclose(float(out.updates["w"][0]), np.float32(max_norm), rtol=2e-7)


def test_small_elements_survive_a_norm_above_float32(impl):
  # The factor (6.4e-10) is a normal float32 though the norm (4.2e38) is not: one multiply,
  # so an element of 4.6e-20 keeps its 2.9e-29 instead of underflowing in a split.
  w = jnp.array([3e38, 3e38, -4.58e-20], jnp.float32)
  out = clipjax.clip_tree({"w": w}, 2.7e29, impl=impl).updates["w"]
  want = np.asarray(w, np.float64) * float(np.float32(2.7e29)) / f64_norm({"w": w})
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-7)


def test_an_inf_leaf_gives_an_inf_norm_in_per_tensor_mode(impl):
  tree = {"a": jnp.array([jnp.inf, 1.0]), "b": jnp.array([1e30])}
  result = clipjax.clip_tree(tree, 1.0, impl=impl, mode="per_tensor")
  assert float(result.global_norm) == np.inf and bool(result.nonfinite)
  assert float(clipjax.global_norm(tree, impl=impl)) == np.inf
  np.testing.assert_allclose(float(result.leaf_norms[1]), 1e30, rtol=1e-7)
