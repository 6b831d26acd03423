"""Bad input gets a clear error that names the problem, never a crash."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import clipjax
from clipjax import _dispatch, _native
from conftest import f64_norm


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan"), float("inf"), -float("inf"), True])
def test_max_norm_must_be_finite_and_positive(max_norm):
  with pytest.raises(ValueError, match="max_norm"):
    clipjax.andrea_clip(max_norm)


@pytest.mark.parametrize("max_norm", ["1.0", [1.0, 2.0], None])
def test_max_norm_must_be_a_scalar_number(max_norm):
  with pytest.raises(ValueError, match="max_norm"):
    clipjax.andrea_clip(max_norm)


def test_max_norm_may_be_a_jax_scalar():
  tx = clipjax.andrea_clip(jnp.float32(2.0), impl="ffi")
  out, _ = tx.update({"g": jnp.array([3.0, 4.0])}, tx.init({"g": jnp.zeros(2)}))
  np.testing.assert_allclose(out["g"], [1.2, 1.6], rtol=1e-7)


@pytest.mark.parametrize("kwargs,word", [({"impl": "cuda"}, "impl"), ({"mode": "layer"}, "mode"),
                                         ({"on_nonfinite": "skip"}, "on_nonfinite")])
def test_unknown_options_are_rejected(kwargs, word):
  with pytest.raises(ValueError, match=word):
    clipjax.andrea_clip(1.0, **kwargs)


@pytest.mark.parametrize("impl", ["jax", "ffi", "auto"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_and_bool_leaves_name_the_leaf(impl, dtype):
  tree = {"layer": {"w": jnp.ones(3), "step": jnp.ones(3, dtype)}}
  tx = clipjax.andrea_clip(1.0, impl=impl)
  with pytest.raises(TypeError, match=r"\['layer'\]\['step'\].*" + jnp.dtype(dtype).name):
    tx.update(tree, tx.init(tree))
  with pytest.raises(TypeError, match=r"\['layer'\]\['step'\]"):
    clipjax.global_norm(tree, impl=impl)


def test_non_array_leaf_names_the_leaf():
  with pytest.raises(TypeError, match=r"\[1\].*str"):
    clipjax.global_norm([jnp.ones(2), "grad"])


def test_python_float_leaves_are_accepted():
  np.testing.assert_allclose(float(clipjax.global_norm([3.0, 4.0], impl="ffi")), 5.0)


def test_ffi_on_a_platform_without_handler_says_which_have_one(monkeypatch):
  platform = _dispatch.default_platform()  # cpu here, cuda on a GPU machine
  monkeypatch.delitem(_native._loaded, platform)
  with pytest.raises(RuntimeError, match=rf"platform '{platform}'.*registered only for"):
    clipjax.clip_tree({"g": jnp.ones(3)}, 1.0, impl="ffi")
  # auto and jax still work there
  clipjax.clip_tree({"g": jnp.ones(3)}, 1.0, impl="auto")
  clipjax.clip_tree({"g": jnp.ones(3)}, 1.0, impl="jax")


def test_ffi_rejects_complex_leaves_by_name_but_auto_handles_them():
  tree = {"z": jnp.array([3.0 + 4.0j, 0.0])}
  with pytest.raises(TypeError, match=r"\['z'\].*complex64"):
    clipjax.clip_tree(tree, 1.0, impl="ffi")
  res = clipjax.clip_tree(tree, 1.0, impl="auto")
  np.testing.assert_allclose(float(res.global_norm), 5.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(res.updates["z"]), [0.6 + 0.8j, 0.0], rtol=1e-6)
  # A norm above the float32 range: scaled by the split factor, not zeroed.
  big = clipjax.clip_tree({"z": jnp.full((4,), 3e38 + 3e38j, jnp.complex64)}, 1.0, impl="auto")
  np.testing.assert_allclose(np.asarray(big.updates["z"]), np.full(4, 0.5 * (1 + 1j) / 2 ** 0.5),
                             rtol=1e-5)


def test_clip_state_without_andrea_clip_is_a_clear_error():
  tx = optax.adamw(1e-3)
  with pytest.raises(ValueError, match="no AndreaClipState"):
    clipjax.clip_state(tx.init({"w": jnp.ones(2)}))


def test_clip_state_finds_the_state_inside_wrappers():
  params = {"w": jnp.ones(2)}
  tx = optax.chain(optax.inject_hyperparams(clipjax.andrea_clip)(max_norm=1.0), optax.adam(1e-3))
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state, params)
  assert float(clipjax.clip_state(state).global_norm) == 5.0


def test_a_bfloat16_scalar_max_norm_is_accepted():
  tx = clipjax.andrea_clip(jnp.asarray(2.0, jnp.bfloat16))
  out, _ = tx.update({"g": jnp.array([3.0, 4.0])}, tx.init({"g": jnp.zeros(2)}))
  np.testing.assert_allclose(out["g"], [1.2, 1.6], rtol=1e-6)


@pytest.mark.parametrize("max_norm, message", [
    (1.0 + 2.0j, "real number; got dtype complex"),
    (np.ones(2, np.float32), r"scalar; got shape \(2,\)"),
])
def test_a_complex_or_vector_max_norm_is_named(max_norm, message):
  with pytest.raises(ValueError, match=message):
    clipjax.andrea_clip(max_norm)


def test_a_traced_vector_max_norm_is_named():
  tree = {"g": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"max_norm must be a scalar; got shape \(2,\)"):
    jax.jit(lambda m: clipjax.clip_tree(tree, m).updates)(jnp.ones(2))


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_python_number_leaves_are_clipped_as_float32_without_warnings(impl):
  # numpy's float64 is a Python float too; without jax_enable_x64 it is float32 here.
  tree = {"a": 3.0, "b": 4, "c": np.float64(0.0)}
  tx = clipjax.andrea_clip(1.0, impl=impl)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    res = clipjax.clip_tree(tree, 1.0, impl=impl)
    out, state = tx.update(tree, tx.init(tree))
    grad = jax.grad(lambda t: clipjax.clip_tree(t, 1.0, impl=impl).global_norm)({"a": 3.0, "b": 4.0})
  for got in (res.updates, out):
    assert {k: v.dtype for k, v in got.items()} == dict.fromkeys("abc", jnp.float32)
    assert {k: float(v) for k, v in got.items()} == {"a": float(np.float32(0.6)),
                                                      "b": float(np.float32(0.8)), "c": 0.0}
  assert float(res.global_norm) == float(state.global_norm) == 5.0
  np.testing.assert_allclose([float(grad["a"]), float(grad["b"])], [0.6, 0.8], rtol=1e-6)


def test_a_bool_leaf_is_rejected_by_name():
  with pytest.raises(TypeError, match=r"\[1\] is a bool, not a floating-point array"):
    clipjax.global_norm([jnp.ones(2), True])


@pytest.mark.parametrize("impl", ["jax", "ffi"])
@pytest.mark.parametrize("on_nonfinite, want", [("zero", 0.0), ("propagate", np.nan)])
@pytest.mark.parametrize("bad", [-1.0, 0.0, np.nan])
def test_an_invalid_traced_max_norm_never_flips_the_updates(impl, on_nonfinite, want, bad):
  # Injected max_norm is traced: no host check can see it; the device treats it like a
  # non-finite norm, counted in the state.
  params = {"g": jnp.zeros(2)}
  tx = optax.inject_hyperparams(
      lambda max_norm: clipjax.andrea_clip(max_norm, impl=impl, on_nonfinite=on_nonfinite))(
          max_norm=1.0)
  state = tx.init(params)
  state.hyperparams["max_norm"] = jnp.asarray(bad, jnp.float32)
  out, state = jax.jit(tx.update)({"g": jnp.array([-0.6, -0.8])}, state)
  np.testing.assert_array_equal(np.abs(np.asarray(out["g"])), [want, want])
  assert int(state.inner_state.nonfinite_count) == 1


# --- the sharded forms' specs ----------------------------------------------------------
# On a mesh of one device: what a spec names is checked before any device is used.


def _one_device_mesh(*names):
  return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def _put(tree, mesh, specs):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k] if isinstance(specs, dict) else specs))
          for k, v in tree.items()}


def test_bad_specs_are_named():
  mesh = _one_device_mesh("data")
  tree = {"w": jnp.ones((8, 2)), "b": jnp.ones((3,))}
  with pytest.raises(ValueError, match="specs"):
    clipjax.sharded_clip_tree(tree, 1.0, mesh=mesh, specs={"w": P("data")})
  with pytest.raises(ValueError, match=r"\['model'\].*does not have"):
    clipjax.sharded_clip_tree(tree, 1.0, mesh=mesh, specs={"w": P("model"), "b": P()})
  with pytest.raises(TypeError, match=r"\['w'\].*PartitionSpec"):
    clipjax.sharded_clip_tree(tree, 1.0, mesh=mesh,
                              specs={"w": NamedSharding(mesh, P()), "b": P()})
  with pytest.raises(ValueError, match="specs="):  # Auto axes: the type says nothing
    jax.jit(lambda t: clipjax.sharded_clip_tree(t, 1.0, mesh=mesh))(_put(tree, mesh, P()))
  with pytest.raises(ValueError, match="specs="):
    clipjax.clip_tree_in_shard_map(tree, 1.0, specs=None)
  with pytest.raises(ValueError, match="pass mesh=.*no single mesh"):  # none to read
    clipjax.sharded_clip_tree(tree, 1.0, specs=P())
  other = _one_device_mesh("model")
  with pytest.raises(ValueError, match="pass mesh=.*no single mesh"):  # two to choose from
    clipjax.sharded_clip_tree({"w": _put(tree, mesh, P())["w"],
                               "b": _put(tree, other, P())["b"]}, 1.0, specs=P())
  empty = clipjax.sharded_clip_tree({}, 1.0, mesh=mesh, specs=P())
  assert empty.updates == {} and float(empty.global_norm) == 0.0


def _in_shard_map(tree, mesh, in_specs, clip_specs):
  step = lambda g: clipjax.clip_tree_in_shard_map(g, 1.0, specs=clip_specs).global_norm
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(in_specs,), out_specs=P()))(
      _put(tree, mesh, in_specs))


def test_inside_shard_map_a_spec_that_misses_an_axis_is_named():
  """shard_map tracks the mesh axes each value varies over, even axes of size 1."""
  mesh = _one_device_mesh("data", "model")
  tree = {"w": jnp.arange(32.0).reshape(4, 8), "b": jnp.ones((5,))}
  in_specs = {"w": P("data", "model"), "b": P()}
  with pytest.raises(ValueError, match=r"\['w'\] varies over mesh axes \['model'\]"):
    _in_shard_map(tree, mesh, in_specs, {"w": P("data"), "b": P()})
  with pytest.raises(ValueError, match=r"\['b'\] is the same on every device along \['data'\]"):
    _in_shard_map(tree, mesh, in_specs, {"w": P("data", "model"), "b": P("data")})
  with pytest.raises(ValueError, match=r"\['w'\] names mesh axis 'fsdp'"):
    _in_shard_map(tree, mesh, in_specs, {"w": P("fsdp", "model"), "b": P()})
  good = _in_shard_map(tree, mesh, in_specs, in_specs)
  np.testing.assert_allclose(float(good), f64_norm(tree), rtol=1e-6)
