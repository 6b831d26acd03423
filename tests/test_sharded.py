"""Sharded gradients: one global norm across devices, with nothing gathered.

The tests run on any even number n >= 2 of devices: a 1-D mesh ("data",) of all n
and a 2-D mesh ("data", "model") of (n // 2, 2), with leaf shapes made from n. Where
jax.device_count() is such an n (several GPUs, say), `pytest tests/test_sharded.py`
runs them there. Otherwise (one device) they are skipped here: XLA fixes the CPU
device count when its backend starts, so `test_on_cpu_devices` (in the slow set) runs
this file again in subprocesses with --xla_force_host_platform_device_count=4, =8 and
=2, where they run. To run them directly on N (even) CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=N pytest tests/test_sharded.py

Every result is checked against the whole, unsharded tree: the float64 NumPy
norm and `clipjax.clip_tree` on one device, with both implementations, the pure-JAX one
also in the form CUDA GPUs run (its sums by rows).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import clipjax
from conftest import compiled_collectives, f64_norm, multi_device_file

test_on_cpu_devices, impl = multi_device_file(__file__)


def _mesh(shape, names, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _mesh1d():
  """All n devices on one axis: ("data",) of (n,)."""
  return _mesh((jax.device_count(),), ("data",))


def _mesh2d(axis_type=AxisType.Auto):
  """("data", "model") of (n // 2, 2)."""
  return _mesh((jax.device_count() // 2, 2), ("data", "model"), axis_type)


def _dims(shape):
  return "[" + ",".join(map(str, shape)) + "]"


def _assert_placed_as(x, mesh, spec):
  """`x` lies as `spec` says (jit may drop a size-1 axis from its spec, as on (1, 2))."""
  assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)


def _put(tree, mesh, specs):
  """`tree` placed as `specs` (its structure or a prefix of it) say."""
  return jax.tree.map(lambda spec, subtree: jax.device_put(subtree, NamedSharding(mesh, spec)),
                      specs, tree, is_leaf=lambda x: isinstance(x, P))


def _tree(shapes, scale=1.0, seed=0):
  """Leaves whose rows differ in size, so every shard holds a different norm."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  tree = {}
  for (name, (shape, dtype)), key in zip(shapes.items(), keys):
    ramp = jnp.linspace(0.1, 3.0, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
    tree[name] = (scale * ramp * jax.random.normal(key, shape)).astype(dtype)
  return tree


def _assert_matches_whole_tree(result, tree, max_norm, impl, mode="global"):
  ref = clipjax.clip_tree(tree, max_norm, impl=impl, mode=mode)
  np.testing.assert_allclose(float(result.global_norm), f64_norm(tree), rtol=1e-6)
  np.testing.assert_allclose(float(result.global_norm), float(ref.global_norm), rtol=1e-6)
  for got, want, leaf in zip(result.leaf_norms, ref.leaf_norms, jax.tree.leaves(tree)):
    np.testing.assert_allclose(float(got), f64_norm(leaf), rtol=1e-6)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert bool(result.clipped) == bool(ref.clipped)
  assert not bool(result.nonfinite)
  for k in tree:
    out = result.updates[k]
    assert out.dtype == tree[k].dtype and out.shape == tree[k].shape
    rtol = 1e-6 if out.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref.updates[k], np.float32),
                               rtol=rtol, atol=0)


def _clip_jitted(tree, max_norm, mesh, specs, impl, **kw):
  clip = jax.jit(lambda t: clipjax.sharded_clip_tree(t, max_norm, mesh=mesh, specs=specs,
                                                     impl=impl, **kw))
  return clip(_put(tree, mesh, specs))


# --- the three layouts -----------------------------------------------------------------


def test_replicated_tree_data_parallel(devices, impl):
  mesh = _mesh1d()
  tree = _tree({"w": ((24, 5), jnp.float32), "b": ((7,), jnp.float32)})
  for max_norm in (1.0, 1e3):
    result = _clip_jitted(tree, max_norm, mesh, P(), impl)
    _assert_matches_whole_tree(result, tree, max_norm, impl)
  # A replicated leaf is counted once, not once per device.
  np.testing.assert_allclose(float(result.global_norm), f64_norm(tree), rtol=1e-6)


def test_fsdp_sharded_on_one_axis(devices, impl):
  mesh, n = _mesh1d(), devices
  tree = _tree({"w": ((8 * n, 16), jnp.float32), "v": ((4 * n,), jnp.bfloat16),
                "bias": ((6,), jnp.float32)})
  specs = {"w": P("data"), "v": P("data"), "bias": P()}
  result = _clip_jitted(tree, 1.0, mesh, specs, impl)
  _assert_matches_whole_tree(result, tree, 1.0, impl)
  assert bool(result.clipped)
  np.testing.assert_allclose(f64_norm(result.updates), 1.0, rtol=1e-2)
  assert result.updates["w"].sharding.spec == P("data")


def test_auto_picks_the_platforms_path_under_jit(devices):
  # impl="auto" (the default): the custom call on CUDA devices, pure JAX elsewhere.
  mesh, n = _mesh1d(), devices
  tree = _tree({"w": ((8 * n, 16), jnp.float32), "v": ((4 * n,), jnp.bfloat16),
                "bias": ((6,), jnp.float32)})
  specs = {"w": P("data"), "v": P("data"), "bias": P()}
  result = _clip_jitted(tree, 1.0, mesh, specs, "auto")
  _assert_matches_whole_tree(result, tree, 1.0, "jax")
  clip = jax.jit(lambda t: clipjax.sharded_clip_tree(t, 1.0, mesh=mesh, specs=specs))
  hlo = clip.lower(_put(tree, mesh, specs)).as_text()
  on_cuda = jax.devices()[0].platform == "gpu" and clipjax.ffi_platforms().count("cuda")
  assert ("clipjax_andrea_clip" in hlo) == bool(on_cuda)


def test_below_max_norm_passes_bit_for_bit(devices, impl):
  mesh, n = _mesh1d(), devices
  tree = _tree({"w": ((8 * n, 16), jnp.float32), "v": ((4 * n,), jnp.bfloat16)})
  result = _clip_jitted(tree, 1e4, mesh, {"w": P("data"), "v": P("data")}, impl)
  assert not bool(result.clipped)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(result.updates[k]).view(np.uint8),
                                  np.asarray(tree[k]).view(np.uint8))


def test_2d_mesh_leaves_on_different_axes(devices, impl):
  mesh, d = _mesh2d(), devices // 2
  tree = _tree({"w": ((4 * d, 8), jnp.float32), "e": ((6, 10), jnp.float32),
                "m": ((2 * d, 3), jnp.float32), "f": ((6 * d,), jnp.bfloat16),
                "b": ((5,), jnp.float32)})
  specs = {"w": P("data", "model"), "e": P(None, "model"), "m": P("data"),
           "f": P(("data", "model")), "b": P()}
  result = _clip_jitted(tree, 2.0, mesh, specs, impl)
  _assert_matches_whole_tree(result, tree, 2.0, impl)
  for k in tree:
    _assert_placed_as(result.updates[k], mesh, specs[k])


def test_per_tensor_mode(devices, impl):
  mesh, d = _mesh2d(), devices // 2
  tree = _tree({"big": ((4 * d, 8), jnp.float32), "small": ((8,), jnp.float32)})
  tree["small"] = tree["small"] * 1e-3
  specs = {"big": P("data", "model"), "small": P("model")}
  result = _clip_jitted(tree, 1.0, mesh, specs, impl, mode="per_tensor")
  _assert_matches_whole_tree(result, tree, 1.0, impl, mode="per_tensor")
  np.testing.assert_allclose(f64_norm(result.updates["big"]), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(result.updates["small"], tree["small"])


@pytest.mark.parametrize("scale", [1e-30, 1e25])
def test_float32_squares_that_underflow_or_overflow(devices, impl, scale):
  mesh, n = _mesh1d(), devices
  tree = _tree({"w": ((8 * n, 16), jnp.float32), "b": ((8,), jnp.float32)}, scale=scale)
  result = _clip_jitted(tree, 1.0, mesh, {"w": P("data"), "b": P()}, impl)
  np.testing.assert_allclose(float(result.global_norm), f64_norm(tree), rtol=1e-6)
  if scale > 1:
    np.testing.assert_allclose(f64_norm(result.updates), 1.0, rtol=1e-6)


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
def test_a_norm_above_float32_made_of_finite_shards_is_scaled_not_zeroed(devices, impl, mode):
  # Every device's shard norm (3e38) fits float32; the whole norm, 3e38 * sqrt(n), does not.
  mesh, n = _mesh1d(), devices
  tree = {"w": jnp.full((n,), 3e38, jnp.float32), "b": jnp.full((2,), 1e-3, jnp.float32)}
  result = _clip_jitted(tree, 1.0, mesh, {"w": P("data"), "b": P()}, impl, mode=mode)
  assert float(result.global_norm) == np.inf  # float32 cannot hold it
  assert bool(result.clipped) and not bool(result.nonfinite)
  whole = f64_norm(tree) if mode == "global" else f64_norm(tree["w"])
  np.testing.assert_allclose(np.asarray(result.updates["w"]), 3e38 / whole, rtol=1e-6)
  if mode == "global":
    ref = clipjax.clip_tree(tree, 1.0, impl=impl)  # the whole tree on one device
    for k in tree:
      np.testing.assert_allclose(result.updates[k], ref.updates[k], rtol=1e-6, atol=1e-45)


# --- NaN and inf -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("on_nonfinite", ["propagate", "zero"])
def test_nonfinite_in_one_shard_reaches_every_device(devices, impl, bad, on_nonfinite):
  mesh, n = _mesh1d(), devices
  tree = _tree({"w": ((8 * n, 4), jnp.float32), "b": ((3,), jnp.float32)})
  bad_device = min(n // 2 + 1, n - 1)  # not the first: the sixth of 8, the second of 2
  tree["w"] = tree["w"].at[8 * bad_device, 1].set(bad)
  specs = {"w": P("data"), "b": P()}
  placed = _put(tree, mesh, specs)
  assert [s.device for s in placed["w"].addressable_shards
          if not np.isfinite(np.asarray(s.data)).all()] == [mesh.devices[bad_device]]
  result = _clip_jitted(placed, 1.0, mesh, specs, impl, on_nonfinite=on_nonfinite)
  ref = clipjax.clip_tree(tree, 1.0, impl=impl, on_nonfinite=on_nonfinite)
  assert bool(result.nonfinite) and bool(result.clipped)
  np.testing.assert_array_equal(float(result.global_norm), float(ref.global_norm))
  for k in tree:
    np.testing.assert_array_equal(result.updates[k], ref.updates[k])
    if on_nonfinite == "zero":
      np.testing.assert_array_equal(result.updates[k], 0.0)


# --- no gradient-sized collectives ---------------------------------------------------------


def test_compiled_hlo_has_no_all_gather(devices, impl):
  mesh, d = _mesh2d(), devices // 2
  tree = _tree({"w": ((24 * d, 40), jnp.float32), "e": ((20, 56), jnp.bfloat16),
                "b": ((9,), jnp.float32)})
  specs = {"w": P("data", "model"), "e": P(None, "model"), "b": P()}
  shard = {k: NamedSharding(mesh, specs[k]).shard_shape(tree[k].shape) for k in tree}
  clip = jax.jit(lambda t: clipjax.sharded_clip_tree(t, 1.0, mesh=mesh, specs=specs, impl=impl))
  hlo = clip.lower(_put(tree, mesh, specs)).compile().as_text()
  collectives = compiled_collectives(hlo)
  assert collectives and {op for op, _ in collectives} == {"all-reduce"}, collectives
  # A few floats per leaf (its norm, and the group's; XLA may merge the pmax and the psum
  # into one all-reduce): nothing gradient-sized.
  assert all(size <= 2 * (len(tree) + 1) for _, size in collectives), collectives
  # Only shards are ever materialised: no buffer has a sharded leaf's whole shape.
  for k in ("w", "e"):
    assert shard[k] != tree[k].shape, (k, shard[k])
    assert _dims(tree[k].shape) not in hlo, k
  if impl == "ffi":
    # The norms of each group of leaves sharded alike, then one call that scales them all.
    assert hlo.count('custom_call_target="clipjax_andrea_clip"') == 3
    assert hlo.count('custom_call_target="clipjax_andrea_scale"') == 1
    assert "f32" + _dims(shard["w"]) in hlo and "bf16" + _dims(shard["e"]) in hlo


# --- inside a training step -----------------------------------------------------------------


def test_andrea_clip_with_mesh_in_a_jitted_adamw_step(devices, impl):
  mesh, d = _mesh2d(), devices // 2
  params = _tree({"w": ((4 * d, 8), jnp.float32), "b": ((8,), jnp.float32)}, seed=1)
  grads = _tree({"w": ((4 * d, 8), jnp.float32), "b": ((8,), jnp.float32)}, seed=2)
  specs = {"w": P("data", "model"), "b": P()}

  def run(tx, params, grads):
    @jax.jit
    def step(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return step(params, tx.init(params))

  adamw = optax.adamw(1e-2, weight_decay=0.1)
  sharded_tx = optax.chain(clipjax.andrea_clip(1.0, impl=impl, mesh=mesh, specs=specs), adamw)
  whole_tx = optax.chain(clipjax.andrea_clip(1.0, impl=impl), adamw)
  got, got_state = run(sharded_tx, _put(params, mesh, specs), _put(grads, mesh, specs))
  want, want_state = run(whole_tx, params, grads)
  np.testing.assert_allclose(float(clipjax.clip_state(got_state).global_norm),
                             float(clipjax.clip_state(want_state).global_norm), rtol=1e-6)
  assert bool(clipjax.clip_state(got_state).clipped)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
    _assert_placed_as(got[k], mesh, specs[k])


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_a_users_own_shard_map(devices, impl, check_vma):
  mesh, d = _mesh2d(), devices // 2
  tree = _tree({"w": ((4 * d, 8), jnp.float32), "m": ((2 * d, 3), jnp.float32),
                "b": ((5,), jnp.float32)})
  specs = {"w": P("data", "model"), "m": P("data"), "b": P()}
  tx = clipjax.andrea_clip(1.0, impl=impl, specs=specs)

  def step(grads):  # this device's shards
    result = clipjax.clip_tree_in_shard_map(grads, 1.0, specs=specs, impl=impl)
    updates, state = tx.update(grads, tx.init(grads))
    return result.updates, updates, result.global_norm, state.global_norm

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs,),
                               out_specs=(specs, specs, P(), P()), check_vma=check_vma))
  clipped, updates, norm, state_norm = step(_put(tree, mesh, specs))
  ref = clipjax.clip_tree(tree, 1.0, impl=impl)
  np.testing.assert_allclose(float(norm), f64_norm(tree), rtol=1e-6)
  assert float(state_norm) == float(norm)
  for k in tree:
    np.testing.assert_allclose(clipped[k], ref.updates[k], rtol=1e-6)
    np.testing.assert_array_equal(updates[k], clipped[k])


@pytest.mark.parametrize("form", ["mesh", "shard_map"])
def test_spikes_with_the_explicit_forms_match_one_device(devices, impl, form):
  """ZScoreSpike with mesh= (the clip's own shard_map) and with specs= (inside the
  caller's): the same spike verdicts, statistics and updates as on one device."""
  mesh, d = _mesh2d(), devices // 2
  specs = {"w": P("data", "model"), "b": P()}
  policy = clipjax.ZScoreSpike(z=2.0, decay=0.9, warmup_steps=3)
  # Each step's tree scaled to these global norms: after the warmup's 1.0, 1.1 and 0.9 the
  # threshold is about 1.16, so step 6 alone is a spike, whatever the device count.
  norms = [10.0, 11.0, 9.0, 10.0, 10.5, 200.0, 10.0]
  stream = []
  for i, norm in enumerate(norms):
    tree = _tree({"w": ((4 * d, 8), jnp.float32), "b": ((8,), jnp.float32)}, seed=10 + i)
    stream.append(jax.tree.map(lambda x, f=norm / f64_norm(tree): x * f, tree))
  whole = clipjax.andrea_clip(5.0, impl=impl, spike=policy)
  if form == "mesh":
    sharded = clipjax.andrea_clip(5.0, impl=impl, spike=policy, mesh=mesh, specs=specs)
    update = jax.jit(sharded.update)
  else:
    sharded = clipjax.andrea_clip(5.0, impl=impl, spike=policy, specs=specs)
    update = jax.jit(jax.shard_map(sharded.update, mesh=mesh, in_specs=(specs, P()),
                                   out_specs=(specs, P())))
  want_state, got_state = whole.init(stream[0]), sharded.init(stream[0])
  spikes = []
  for grads in stream:
    want, want_state = jax.jit(whole.update)(grads, want_state)
    got, got_state = update(_put(grads, mesh, specs), got_state)
    spikes.append(bool(got_state.spike))
    assert bool(got_state.spike) == bool(want_state.spike)
    for field in ("global_norm", "norm_mean", "norm_var", "leaf_norms"):
      np.testing.assert_allclose(getattr(got_state, field), getattr(want_state, field),
                                 rtol=1e-5, err_msg=field)
    for k in grads:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
      _assert_placed_as(got[k], mesh, specs[k])
  assert spikes == [False] * 5 + [True, False]
  assert int(got_state.spike_count) == int(want_state.spike_count) == 1


def test_specs_read_from_the_arrays(devices, impl):
  d = devices // 2
  tree = _tree({"w": ((4 * d, 8), jnp.float32), "b": ((8,), jnp.float32)})
  specs = {"w": P("data", "model"), "b": P()}
  # Concrete arrays carry their NamedSharding (here on Auto axes).
  auto = _put(tree, _mesh2d(), specs)
  _assert_matches_whole_tree(clipjax.sharded_clip_tree(auto, 1.0, impl=impl), tree, 1.0, impl)
  # Inside jit the types carry it on a mesh with Explicit axes.
  explicit = _put(tree, _mesh2d(AxisType.Explicit), specs)
  result = jax.jit(lambda t: clipjax.sharded_clip_tree(t, 1.0, impl=impl))(explicit)
  _assert_matches_whole_tree(result, tree, 1.0, impl)
  assert result.updates["w"].sharding.spec == P("data", "model")


def test_outside_jit_the_clip_is_compiled_once_and_cached(devices, impl):
  """A call outside jit runs one jitted program, kept in jit's cache: a second call (here
  with another max_norm, an operand) runs it again rather than tracing and compiling a
  shard_map anew."""
  from clipjax import _clip_tree  # pylint: disable=g-import-not-at-top
  mesh, d = _mesh2d(), devices // 2
  specs = {"w": P("data", "model"), "b": P()}
  tree = _tree({"w": ((4 * d, 6), jnp.float32), "b": ((6,), jnp.float32)})  # shapes of its own
  placed = _put(tree, mesh, specs)
  cached = _clip_tree._sharded_clip_jitted._cache_size
  before = cached()
  clipjax.sharded_clip_tree(placed, 1.0, mesh=mesh, specs=specs, impl=impl)
  assert cached() == before + 1
  second = clipjax.sharded_clip_tree(placed, 0.5, mesh=mesh, specs=specs, impl=impl)
  assert cached() == before + 1
  _assert_matches_whole_tree(second, tree, 0.5, impl)
  for k in specs:
    _assert_placed_as(second.updates[k], mesh, specs[k])
  with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
    clipjax.sharded_clip_tree(placed, -1.0, mesh=mesh, specs=specs, impl=impl)
