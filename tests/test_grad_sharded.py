"""Differentiating through the clip on sharded gradients: the plain drop-in under `jax.jit`,
the clip with `mesh=`, and `clip_tree_in_shard_map` inside the caller's own `shard_map`,
each against one device's derivative (tests/test_grad.py checks that one against float64).

Like tests/test_sharded.py, these run where jax sees an even number >= 2 of devices, and
otherwise in subprocesses on 4, 8 and 2 CPU devices (`test_on_cpu_devices`, in the slow
set).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import clipjax
from conftest import multi_device_file

test_on_cpu_devices, impl = multi_device_file(__file__)


def _mesh():
  n = jax.device_count()
  return jax.make_mesh((n // 2, 2), ("data", "model"))


def _tree(n, seed):
  """Leaves split on both axes, on one, and whole, in float32 and bfloat16."""
  d = n // 2
  shapes = {"w": ((4 * d, 8), jnp.float32), "v": ((2 * d, 6), jnp.bfloat16),
            "b": ((5,), jnp.float32)}
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {k: jax.random.normal(key, shape).astype(dtype)
          for key, (k, (shape, dtype)) in zip(keys, shapes.items())}


SPECS = {"w": P("data", "model"), "v": P("data"), "b": P()}


def _put(tree, mesh):
  return {k: jax.device_put(x, NamedSharding(mesh, SPECS[k])) for k, x in tree.items()}


def _loss(tx, weights):
  """sum(weights * the clipped updates), in float32."""
  def loss(tree):
    updates, _ = tx.update(tree, tx.init(tree))
    return sum(jnp.sum(updates[k].astype(jnp.float32) * weights[k].astype(jnp.float32))
               for k in tree)
  return loss


def _assert_close(got, want):
  for k in want:
    tol = 1e-5 if want[k].dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32),
                               rtol=tol, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("form", ["plain", "mesh"])
def test_the_derivative_on_sharded_leaves_is_one_devices(devices, impl, form):
  """The plain drop-in (partitioned by XLA) and the clip with `mesh=` (its own shard_map):
  the same derivative as one device's, each gradient kept where its leaf is."""
  mesh = _mesh()
  tree, weights = _tree(devices, seed=4), _tree(devices, seed=5)
  kw = dict(mesh=mesh, specs=SPECS) if form == "mesh" else {}
  got = jax.jit(jax.grad(_loss(clipjax.andrea_clip(1.0, impl=impl, **kw), weights)))(
      _put(tree, mesh))
  want = jax.grad(_loss(clipjax.andrea_clip(1.0, impl=impl), weights))(tree)
  _assert_close(got, want)
  for k, x in got.items():
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), x.ndim), k


def test_the_derivative_inside_a_users_own_shard_map(devices, impl):
  """impl="jax": the pure-JAX clip of the shards, differentiated as it is, gives one
  device's derivative. The custom call has none there, and says what to do instead."""
  mesh = _mesh()
  tree, weights = _tree(devices, seed=6), _tree(devices, seed=7)["w"]

  def local(grads, weights):  # this device's shards; the loss reads the leaf split on both
    updates = clipjax.clip_tree_in_shard_map(grads, 1.0, specs=SPECS, impl=impl).updates
    return jax.lax.psum(jnp.sum(updates["w"] * weights), ("data", "model"))

  loss = jax.shard_map(local, mesh=mesh, in_specs=(SPECS, SPECS["w"]), out_specs=P())
  grad = jax.jit(jax.grad(loss))
  args = (_put(tree, mesh), jax.device_put(weights, NamedSharding(mesh, SPECS["w"])))
  if impl == "ffi":
    with pytest.raises(TypeError, match="impl='jax'"):
      grad(*args)
    return
  want = jax.grad(lambda t: jnp.sum(clipjax.clip_tree(t, 1.0, impl="jax").updates["w"]
                                    * weights))(tree)
  _assert_close(grad(*args), want)
