"""Differentiating through the clip: `jax.grad` and `jax.jvp` of the norm, of the clip, and
of an optimizer chain holding it, on every path (the custom call, and the pure-JAX path leaf
by leaf and by rows), against float64's derivative and optax's.

The custom call and `custom_partitioning` have no derivative of their own: every path
takes the pure-JAX clip's (`_dispatch.tangent_of`), whose norms carry theirs
(`_backend.pure_jax.norms`), so that it holds where the squares overflow or underflow as well.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from conftest import SHARDED_IMPLS, impl_named


def _tree(scale, dtype=jnp.float32):
  rng = np.random.default_rng(7)
  shapes = {"a": (8, 6), "b": (5,), "c": (3, 4, 2)}
  return {k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32).astype(dtype)
          for k, s in shapes.items()}


def _weights(tree):
  rng = np.random.default_rng(8)
  return {k: jnp.asarray(rng.standard_normal(x.shape), x.dtype) for k, x in tree.items()}


def _f64(tree):
  return {k: np.asarray(x, np.float64) for k, x in tree.items()}


def _clip_grad_f64(tree, w, max_norm, mode):
  """d/dx of sum(w * clip(x)) in float64: w where a norm is at most max_norm; above it,
  s * w - s * <w, x> / n**2 * x with s = max_norm / n, n the global norm or the leaf's."""
  x, w = _f64(tree), _f64(w)
  groups = [list(x)] if mode == "global" else [[k] for k in x]
  out = {}
  for keys in groups:
    n = np.sqrt(sum(np.sum(x[k] ** 2) for k in keys))
    if n <= max_norm:
      out.update({k: w[k] for k in keys})
      continue
    s, wx = max_norm / n, sum(np.sum(w[k] * x[k]) for k in keys)
    out.update({k: s * w[k] - s * wx / n**2 * x[k] for k in keys})
  return out


def _assert_close(got, want, rtol):
  """Normwise over the tree: |got - want| <= rtol |want|."""
  err = np.sqrt(sum(np.sum((np.asarray(got[k], np.float64) - want[k]) ** 2) for k in want))
  ref = np.sqrt(sum(np.sum(want[k] ** 2) for k in want))
  assert np.isfinite(err) and err <= rtol * ref, (err, ref)


# The ends of the range: at 1e25 the plain squares overflow float32, at 1e-25 they underflow.
SCALES = [1.0, 1e25, 1e-25]


@pytest.mark.parametrize("impl_name", SHARDED_IMPLS)
@pytest.mark.parametrize("scale", SCALES)
def test_the_norms_derivative_is_x_over_the_norm(impl_name, scale, request):
  impl = impl_named(impl_name, request)
  tree = _tree(scale)
  x = _f64(tree)
  n = np.sqrt(sum(np.sum(v ** 2) for v in x.values()))
  got = jax.jit(jax.grad(lambda t: clipjax.global_norm(t, impl=impl)))(tree)
  _assert_close(got, {k: v / n for k, v in x.items()}, 1e-6)
  # Forward mode, along the tree itself: d|x| = <x, x> / |x| = |x|.
  _, tangent = jax.jvp(lambda t: clipjax.global_norm(t, impl=impl), (tree,), (tree,))
  np.testing.assert_allclose(float(tangent), n, rtol=1e-6)


@pytest.mark.parametrize("impl_name", SHARDED_IMPLS)
@pytest.mark.parametrize("mode", ["global", "per_tensor"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("clipped", [True, False])
def test_the_clips_derivative_matches_float64(impl_name, mode, scale, clipped, request):
  impl = impl_named(impl_name, request)
  tree = _tree(scale)
  w = _weights(tree)
  norms = [np.sqrt(np.sum(v ** 2)) for v in _f64(tree).values()]
  if mode == "global":
    n = np.sqrt(sum(m**2 for m in norms))
    max_norm = n / 2 if clipped else 2 * n
  else:  # every leaf clipped, or none
    max_norm = min(norms) / 2 if clipped else 2 * max(norms)
  tx = clipjax.andrea_clip(float(max_norm), impl=impl, mode=mode)

  def loss(t):
    updates, _ = tx.update(t, tx.init(t))
    return sum(jnp.sum(updates[k] * w[k]) for k in t)

  got = jax.jit(jax.grad(loss))(tree)
  _assert_close(got, _clip_grad_f64(tree, w, max_norm, mode), 1e-5)


@pytest.mark.parametrize("impl_name", [*SHARDED_IMPLS, "auto"])
@pytest.mark.parametrize("max_norm", [1.0, 100.0])  # clipped, and not
def test_a_meta_gradient_through_a_chain_matches_optax(impl_name, max_norm, request):
  """The derivative of the parameters after one step of the chain with respect to the
  gradients, the learning rate and max_norm (held as state, `optax.inject_hyperparams`):
  as optax's chain gives them, to float32 rounding."""
  impl = impl_named(impl_name, request)
  grads, params = _tree(1.0), _weights(_tree(1.0))

  def after_step(make_clip):
    def f(grads, learning_rate, max_norm):
      clip = optax.inject_hyperparams(make_clip)(max_norm=max_norm)
      tx = optax.chain(clip, optax.sgd(learning_rate, momentum=0.9))
      updates, _ = tx.update(grads, tx.init(params), params)
      new = optax.apply_updates(params, updates)
      return sum(jnp.sum(jnp.sin(v)) for v in new.values())
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(grads, 0.1, max_norm)

  got_g, *got = after_step(lambda max_norm: clipjax.andrea_clip(max_norm, impl=impl))
  want_g, *want = after_step(optax.clip_by_global_norm)
  _assert_close(got_g, _f64(want_g), 1e-5)
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
def test_the_scale_kernels_path_has_the_same_derivative(mode):
  """scale="kernel": the custom call writes the clipped leaves itself, over its operands."""
  tree = _tree(1.0)
  w = _weights(tree)
  norms = [np.sqrt(np.sum(v ** 2)) for v in _f64(tree).values()]
  max_norm = float(min(norms)) / 2

  def loss(t):
    tx = clipjax.andrea_clip(max_norm, impl="ffi", mode=mode, scale="kernel")
    updates, _ = tx.update(t, tx.init(t))
    return sum(jnp.sum(updates[k] * w[k]) for k in t)

  _assert_close(jax.jit(jax.grad(loss))(tree), _clip_grad_f64(tree, w, max_norm, mode), 1e-5)


def test_bfloat16_leaves_get_the_derivative_in_their_own_dtype(impl):
  tree = _tree(1.0, jnp.bfloat16)
  w = _weights(tree)
  n = np.sqrt(sum(np.sum(v ** 2) for v in _f64(tree).values()))
  tx = clipjax.andrea_clip(float(n) / 2, impl=impl)

  def loss(t):
    updates, _ = tx.update(t, tx.init(t))
    return sum(jnp.sum(updates[k].astype(jnp.float32) * w[k].astype(jnp.float32)) for k in t)

  got = jax.grad(loss)(tree)
  assert all(v.dtype == jnp.bfloat16 for v in got.values())
  _assert_close(got, _clip_grad_f64(tree, w, float(n) / 2, "global"), 2.0**-7)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_skip_spikes_choice_passes_the_chosen_arrays_derivative(skip, dtype):
  """`skip_spikes` chooses between arrays on their bits, which carry no derivative: the
  choice passes the chosen array's."""
  from clipjax._skip import pick
  a, b = jnp.arange(4.0, dtype=dtype), jnp.arange(4.0, 8.0, dtype=dtype)
  w = jnp.asarray([1.0, -2.0, 3.0, 0.5], dtype)
  da, db = jax.grad(lambda a, b: jnp.sum(pick(jnp.asarray(skip), a, b) * w), (0, 1))(a, b)
  zero = jnp.zeros_like(w)
  np.testing.assert_array_equal(da, w if skip else zero)
  np.testing.assert_array_equal(db, zero if skip else w)


def test_a_chain_under_skip_spikes_has_the_chains_derivative_on_a_kept_step(impl):
  tree = _tree(1.0)
  w = _weights(tree)

  def grad(tx):
    def loss(t):
      updates, _ = tx.update(t, tx.init(t), t)
      return sum(jnp.sum(updates[k] * w[k]) for k in t)
    return jax.jit(jax.grad(loss))(tree)

  def chain():
    return optax.chain(clipjax.andrea_clip(1.0, impl=impl), optax.adamw(0.1))

  got, want = grad(clipjax.skip_spikes(chain())), grad(chain())
  assert any(float(jnp.max(jnp.abs(v))) > 0 for v in want.values())
  _assert_close(got, _f64(want), 1e-6)


@pytest.mark.parametrize("skip", [False, True])
def test_the_derivatives_leave_the_compiled_step_as_it_was(impl, skip, monkeypatch):
  """The `custom_jvp`s that give the derivatives are traced away before XLA sees the step:
  its compiled instructions are those of the same step without them."""
  from clipjax import _dispatch, _skip
  params = _weights(_tree(1.0))

  def instructions():
    jax.clear_caches()
    clip = clipjax.andrea_clip(1.0, impl=impl, spike=clipjax.ZScoreSpike() if skip else None)
    tx = optax.chain(clip, optax.adamw(1e-3))
    tx = clipjax.skip_spikes(tx) if skip else tx

    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    text = jax.jit(step).lower(params, tx.init(params), params).compile().as_text()
    text = re.sub(r"metadata=\{[^}]*\}|\.\d+", "", text)  # source lines, numbering
    return [line for line in text.splitlines() if " = " in line]

  with_them = instructions()
  monkeypatch.setattr(_dispatch, "differentiable", lambda clip, m, leaves, _: clip(m, leaves))
  monkeypatch.setattr(_skip, "pick", _skip.pick.fun)
  assert instructions() == with_them
  jax.clear_caches()
