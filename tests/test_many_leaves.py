"""A tree of more leaves than one custom call takes (`_ffi.MAX_LEAVES_PER_CALL`): norm
calls and scale calls of that many leaves each, with the decision between them. Same
contract as one call: the norm of the whole tree, one decision, every leaf scaled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from clipjax import _native
from clipjax._backend import ffi as _ffi
from conftest import f64_norm

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")

N = 2 * _ffi.MAX_LEAVES_PER_CALL + 3  # three calls' worth


def _tree(seed=0):
  # Cast by NumPy and put on the device as they are: a cast by JAX compiles per shape.
  rng = np.random.default_rng(seed)
  dtypes = (np.float32, jnp.bfloat16, np.float16)
  return {f"p{i:04d}": jax.device_put(rng.standard_normal(int(rng.integers(0, 40)))
                                      .astype(dtypes[i % 3])) for i in range(N)}


def _custom_calls(fn, *args):
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return (hlo.count('custom_call_target="clipjax_andrea_clip"'),
          hlo.count('custom_call_target="clipjax_andrea_scale"'))


def _assert_clipped_by(got, x, norm, name):
  """`got` is leaf `x` clipped by a float64 `norm` to max_norm 1, within 2 ulps."""
  want = np.asarray(x, np.float64) * min(1.0, 1.0 / norm) if norm else np.asarray(x, np.float64)
  eps = float(jnp.finfo(x.dtype).eps)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 * eps, atol=1e-7,
                             err_msg=name)


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
def test_matches_float64(mode):
  tree = _tree()
  got = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", mode=mode))(tree)
  norms = {k: f64_norm({k: v}) for k, v in tree.items()}
  np.testing.assert_allclose(float(got.global_norm), f64_norm(tree), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got.leaf_norms, np.float64), list(norms.values()),
                             rtol=1e-6)
  assert bool(got.clipped)
  for k, x in tree.items():
    _assert_clipped_by(got.updates[k], x, f64_norm(tree) if mode == "global" else norms[k], k)


def test_is_clipped_by_three_norm_calls_and_three_scale_calls():
  tree = _tree()
  assert _custom_calls(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates, tree) == (3, 3)
  assert _custom_calls(lambda t: clipjax.global_norm(t, impl="ffi"), tree) == (3, 0)


def test_below_max_norm_is_bit_identical_and_nan_zeroes_every_leaf():
  tree = _tree(1)
  clip = jax.jit(lambda t, max_norm: clipjax.clip_tree(t, max_norm, impl="ffi",
                                                       on_nonfinite="zero"))
  out = clip(tree, 1e6)
  assert not bool(out.clipped)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out.updates[k]).view(np.uint8),
                                  np.asarray(tree[k]).view(np.uint8))
  tree["p0007"] = tree["p0007"].at[0].set(jnp.nan)
  zeroed = clip(tree, 1.0)
  assert bool(zeroed.nonfinite)
  assert all(not np.any(np.asarray(v, np.float32)) for v in zeroed.updates.values())


def test_one_device_traces_the_custom_calls_alone():
  """Where nothing can be split, neither JAX's partitioner hook nor its vmap hook is traced
  (their per-leaf work is what many leaves pay for); tests/test_gspmd.py checks that they
  are where there are devices to split over."""
  if jax.device_count() != 1:
    pytest.skip(f"checks the single-device path; this process sees {jax.device_count()}")
  text = str(jax.make_jaxpr(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates)(_tree()))
  assert "ffi_call" in text
  assert "custom_partitioning" not in text and "custom_vmap" not in text


def test_vmap_clips_each_tree_on_its_own():
  tree = _tree(2)
  factors = (0.01, 1.0, 30.0)  # below max_norm, near it, far above it
  batch = {k: jax.device_put(np.stack([np.asarray(x, np.float32) * f for f in factors])
                             .astype(x.dtype)) for k, x in tree.items()}
  got = jax.jit(jax.vmap(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi")))(batch)
  for i in range(len(factors)):
    one = {k: v[i] for k, v in batch.items()}
    norm = f64_norm(one)
    np.testing.assert_allclose(float(got.global_norm[i]), norm, rtol=1e-6)
    assert bool(got.clipped[i]) == (norm > 1.0)
    for k, x in one.items():
      _assert_clipped_by(got.updates[k][i], x, norm, f"{k}, tree {i}")


def _kernels_between_calls(calls, mode):
  """The fusions XLA compiles the clip of a tree of `calls` norm calls' worth into."""
  rng = np.random.default_rng(3)
  tree = [jax.device_put(rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32))
          for _ in range((calls - 1) * _ffi.MAX_LEAVES_PER_CALL + 3)]
  hlo = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", mode=mode)).lower(tree)
  entry = hlo.compile().as_text().split("\nENTRY", 1)[1]
  return entry.count(" fusion(")


def test_the_decision_between_calls_compiles_to_kernels_that_do_not_grow_with_the_calls():
  """The calls' norms are laid end to end and read whole: no kernel per call (XLA:CPU
  compiles each kernel on its own; four per call cost about 2.5 s at 20,000 leaves). Per tensor,
  each scale call reads its own slice of the factors and actions: two per call."""
  assert _kernels_between_calls(9, "global") == _kernels_between_calls(5, "global")
  assert (_kernels_between_calls(9, "per_tensor")
          <= _kernels_between_calls(5, "per_tensor") + 2 * (9 - 5))


def _pure_jax_adds(leaves):
  tree = [jnp.ones((7 + i % 5,), jnp.float32) for i in range(leaves)]
  fn = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax"))
  return fn.lower(tree).compile().as_text().count(" add(")


def test_the_pure_jax_totals_are_one_reduction():
  """The pure-JAX clip adds up its leaves' sums in one reduction, so its compiled program
  grows by one add per leaf (the leaf's own reduction). A plain sum of the stacked sums
  became a chain of one add per leaf in XLA:CPU, copied into several fusions (four adds
  per leaf, and a quarter longer compile at 2,000 leaves); three sorts took three kernels on
  a GPU. Lowered for CUDA, the program holds no sort."""
  assert (_pure_jax_adds(200) - _pure_jax_adds(100)) / 100 < 1.5
  tree = [jnp.ones((768, 4)), jnp.ones((768,)), jnp.ones((5,))]
  lowered = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax")).trace(tree).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.sort" not in lowered
