"""Scale factors and norms at the ends of float32's range, on both paths."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax._backend import pure_jax
from conftest import f64_norm

# jax.enable_x64 where this jax has it; jax 0.7.2 has only jax.experimental's.
enable_x64 = getattr(jax, "enable_x64", None)
if enable_x64 is None:
  from jax.experimental import enable_x64


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


# float64 leaves (with x64 on) are clipped in float64, norm and scale, on every path that
# takes them; the custom call refuses them by name (tests/test_bad_input.py).
F64_CASES = [
    # (leaf, max_norm, on_nonfinite, expected updates)
    ([1e300, 1.0], 1.0, "zero", [1.0, 1e-300]),
    ([3.0, 4.0 + 1e-12], 1.0, "propagate", None),
    ([1e200, -1e200], 1e-100, "propagate", None),
]


@pytest.mark.parametrize("leaf, max_norm, on_nonfinite, want", F64_CASES)
def test_float64_leaves_are_clipped_in_float64(leaf, max_norm, on_nonfinite, want):
  with enable_x64(True):
    x = np.asarray(leaf, np.float64)
    b = np.full(2, np.float32(1e-3))
    result = clipjax.clip_tree({"w": jnp.asarray(x), "b": jnp.asarray(b)}, max_norm,
                               on_nonfinite=on_nonfinite)
    norm = float(np.hypot.reduce(np.concatenate([x, b.astype(np.float64)])))
    assert result.global_norm.dtype == jnp.float64
    assert float(result.global_norm) == pytest.approx(norm, rel=1e-15)
    assert not bool(result.nonfinite) and bool(result.clipped)
    got = np.asarray(result.updates["w"])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want if want else x * (max_norm / norm), rtol=1e-15)


def test_float64_state_keeps_its_dtype_through_an_optax_chain():
  with enable_x64(True):
    params = {"w": jnp.asarray([3.0, 4.0], jnp.float64)}
    tx = optax.chain(clipjax.andrea_clip(1.0, mode="per_tensor"), optax.sgd(1.0))
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(params, state, params)
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
    clip = clipjax.clip_state(new_state)
    assert float(clip.global_norm) == 5.0 and clip.global_norm.dtype == jnp.float64
    # The other norms are float32 whatever the tree, as the state's fields say.
    assert clip.leaf_norms.dtype == clip.norm_mean.dtype == clip.norm_var.dtype == jnp.float32
    assert float(clip.leaf_norms[0]) == 5.0 and bool(clip.clipped)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.6, -0.8], rtol=1e-15)


def _range_tree():
  """Leaves of every rank and of both ends of float32's range, and one of more rows than the
  pure-JAX path keeps row sums for."""
  rng = np.random.default_rng(7)
  return {
      "scalar": jnp.float32(3e30),
      "vector": jnp.asarray(rng.normal(size=768), jnp.float32),
      "huge": jnp.full((2, 2), 1e38, jnp.float32),
      "huge_too": jnp.full((2,), 2e38, jnp.float32),  # with "huge": a norm above float32's
      "tiny": jnp.asarray(rng.normal(size=(6, 5)) * 1e-35, jnp.float32),  # squares underflow
      "cube": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.bfloat16),
      "complex": jnp.asarray(rng.normal(size=(5, 2)) + 1j * rng.normal(size=(5, 2)),
                             jnp.complex64),
      "tall": jnp.asarray(rng.normal(size=(pure_jax._MAX_ROWS + 3, 1)), jnp.float32),
      "also_768": jnp.asarray(rng.normal(size=(768, 2)) * 1e-25, jnp.float32),
  }


@pytest.mark.parametrize("by_rows", [True, False])
def test_pure_jax_sums_by_rows_and_by_leaf_give_the_same_norms(request, by_rows):
  """The pure-JAX path finishes the leaves' row sums together on CUDA GPUs, and elsewhere
  reduces each leaf whole: the same norms either way, each within float32 rounding of
  float64's, at both ends of the range."""
  tree = _range_tree()
  if by_rows:
    request.getfixturevalue("sum_by_rows_here")
  # A fresh function for each setting: jit would reuse the other's trace.
  result = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax", mode="per_tensor"))(tree)
  for i, (name, leaf) in enumerate(sorted(tree.items())):  # the leaves' order
    np.testing.assert_allclose(float(result.leaf_norms[i]), f64_norm(leaf), rtol=2e-6,
                               err_msg=name)
  # The global norm is above float32's range: its factor still clips each leaf right.
  overall = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax"))(tree)
  assert float(overall.global_norm) == np.inf and not bool(overall.nonfinite)
  np.testing.assert_allclose(np.asarray(overall.updates["huge"], np.float64),
                             1e38 / f64_norm(tree), rtol=2e-7)

