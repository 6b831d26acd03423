"""Per-leaf norms in the state, the z-score spike policy and `skip_spikes`, on both paths
(the custom call runs its CPU handler here, its CUDA kernels on a GPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from conftest import f64_norm

POLICY = clipjax.ZScoreSpike(z=2.5, decay=0.97, warmup_steps=5)


def _params():
  return {"emb": jnp.zeros((16, 8)), "layers": [{"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}],
          "bias": None}


def _grads(step, scale=1.0):
  """Gradients whose norm wanders by a few percent step to step, times `scale`."""
  rng = np.random.default_rng(step)
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale, jnp.float32),
                      _params())


# Steps with 30x gradients (spikes after the warmup), and one NaN step.
SPIKES, NAN_STEP = (9, 17), 13


def _stream(n=22):
  out = []
  for t in range(n):
    g = _grads(t, 30.0 if t in SPIKES else 1.0)
    if t == NAN_STEP:
      g["emb"] = g["emb"].at[0, 0].set(jnp.nan)
    out.append(g)
  return out


def _reference(norms, max_norm, policy):
  """ZClip's statistics in NumPy (float64): per step (spike, limit, mean, var)."""
  buf, mean, var, out = [], 0.0, 0.0, []
  for g in norms:
    if not np.isfinite(g):
      out.append((False, max_norm, mean, var))
      continue
    if len(buf) < policy.warmup_steps:
      buf.append(g)
      mean, var = np.mean(buf), np.var(buf)
      out.append((False, max_norm, mean, var))
      continue
    threshold = mean + policy.z * np.sqrt(var)
    spike = g > threshold
    x = threshold if spike else g
    mean = policy.decay * mean + (1 - policy.decay) * x
    var = policy.decay * var + (1 - policy.decay) * (x - mean) ** 2
    out.append((spike, min(max_norm, threshold) if spike else max_norm, mean, var))
  return out


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_leaf_norms_are_always_in_the_state(impl):
  tx = clipjax.andrea_clip(1.0, impl=impl)
  params, grads = _params(), _grads(0, 3.0)
  _, state = jax.jit(tx.update)(grads, tx.init(params))
  leaves = jax.tree.leaves(grads)
  assert state.leaf_norms.dtype == jnp.float32 and state.leaf_norms.shape == (len(leaves),)
  np.testing.assert_allclose(np.asarray(state.leaf_norms), [f64_norm(x) for x in leaves],
                             rtol=1e-6)
  named = clipjax.named_leaf_norms(state, params)
  assert list(named) == ["emb", "layers/0/b", "layers/0/w"]
  assert all(type(v) is float for v in named.values())  # for logging: on the host
  np.testing.assert_allclose(named["emb"], f64_norm(grads["emb"]), rtol=1e-6)
  # Inside jit the same names, with traced norms.
  traced = jax.jit(lambda s: clipjax.named_leaf_norms(s, params))(state)
  assert {k: float(v) for k, v in traced.items()} == named


def test_named_leaf_norms_are_named_as_flax_and_orbax_name_paths():
  params = {"blocks": [{"attn": {"q": {"kernel": jnp.zeros((2, 2))}}}], "head": jnp.zeros(3)}
  tx = clipjax.andrea_clip(1.0)
  _, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params))
  assert clipjax.named_leaf_norms(state, params) == {"blocks/0/attn/q/kernel": 2.0,
                                                     "head": float(np.float32(3.0 ** 0.5))}


def test_named_leaf_norms_needs_the_optimizers_params():
  tx = optax.chain(clipjax.andrea_clip(1.0), optax.sgd(0.1))
  state = tx.init(_params())
  with pytest.raises(ValueError, match="holds 3 leaf norms, but params has 1 leaves"):
    clipjax.named_leaf_norms(state, {"w": jnp.zeros(3)})


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_spikes_are_detected_and_the_statistics_follow_zclip(impl):
  max_norm = 1e3  # above every ordinary norm (about 14): only spikes clip
  tx = clipjax.andrea_clip(max_norm, impl=impl, spike=POLICY)
  update = jax.jit(tx.update)
  state = tx.init(_params())
  got, norms = [], []
  for t, g in enumerate(_stream()):
    out, state = update(g, state)
    norms.append(float(state.global_norm))
    got.append((bool(state.spike), float(f64_norm(out)) if t != NAN_STEP else None,
                float(state.norm_mean), float(state.norm_var)))
  want = _reference(norms, max_norm, POLICY)
  assert [t for t, g in enumerate(got) if g[0]] == list(SPIKES)
  assert int(state.spike_count) == len(SPIKES) and int(state.nonfinite_count) == 1
  assert int(state.norm_count) == len(norms) - 1  # the NaN step never entered the statistics
  for t, ((spike, out_norm, mean, var), (w_spike, limit, w_mean, w_var)) in enumerate(
      zip(got, want)):
    assert spike == w_spike, t
    np.testing.assert_allclose(mean, w_mean, rtol=1e-5, err_msg=f"step {t}")
    np.testing.assert_allclose(var, w_var, rtol=1e-4, err_msg=f"step {t}")
    if out_norm is not None:  # a spike step clips to the threshold, others pass
      np.testing.assert_allclose(out_norm, min(norms[t], limit), rtol=1e-5, err_msg=f"step {t}")


def test_a_spike_clips_to_max_norm_when_that_is_lower():
  # Ordinary norms are about 14 and the threshold about 15: max_norm 10 is below both.
  tx = clipjax.andrea_clip(10.0, spike=POLICY)
  update, state = jax.jit(tx.update), tx.init(_params())
  for g in _stream(SPIKES[0] + 1):
    out, state = update(g, state)
  assert bool(state.spike) and float(state.norm_mean) > 10.0
  np.testing.assert_allclose(f64_norm(out), 10.0, rtol=1e-6)


def test_spikes_clip_alike_whoever_scales():
  """The policy sets the max_norm the clip runs with, so the custom call's kernel and the
  fused multiply give the same bits and the same statistics."""
  runs = []
  for scale in ("fused", "kernel"):
    tx = clipjax.andrea_clip(1e3, impl="ffi", scale=scale, spike=POLICY)
    update, state, outs = jax.jit(tx.update), tx.init(_params()), []
    for g in _stream():
      out, state = update(g, state)
      outs.append(_bits(out))
    runs.append((outs, _bits(state)))
  assert runs[0] == runs[1]


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_a_norm_above_float32_is_a_spike_after_the_warmup(impl):
  """Finite leaves whose norm overflows float32: after the warmup a spike, clipped to the
  threshold and entered into the statistics as it; before it, left out of them."""
  huge = {"emb": jnp.full((16, 8), 1e38, jnp.float32), "layers": [
      {"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}], "bias": None}  # norm 1.1e39
  tx = clipjax.andrea_clip(1e3, impl=impl, spike=POLICY)
  update, state = jax.jit(tx.update), tx.init(_params())
  _, state = update(huge, state)  # in the warmup: not a spike, not in the statistics
  assert not bool(state.spike) and int(state.norm_count) == 0
  assert float(state.norm_mean) == 0.0 and not bool(state.nonfinite_count)
  for g in _stream(POLICY.warmup_steps):
    _, state = update(g, state)
  threshold = float(state.norm_mean) + POLICY.z * np.sqrt(float(state.norm_var))
  count = int(state.norm_count)
  out, state = update(huge, state)
  assert bool(state.spike) and int(state.spike_count) == 1 and not bool(state.nonfinite_count)
  assert int(state.norm_count) == count + 1 and np.isfinite(float(state.norm_mean))
  np.testing.assert_allclose(f64_norm(out), threshold, rtol=1e-5)


def _chain(impl, **skip):
  inner = optax.chain(clipjax.andrea_clip(1e3, impl=impl, spike=POLICY),
                      optax.adamw(1e-2, weight_decay=0.1))
  return clipjax.skip_spikes(inner, **skip)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_skip_spikes_leaves_the_inner_state_as_it_was(impl):
  tx = _chain(impl)
  params = jax.tree.map(lambda p: p + 0.5, _params())
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for t, g in enumerate(_stream()):
    before = state
    updates, state = step(g, state, params)
    clip_before, clip_after = clipjax.clip_state(before), clipjax.clip_state(state)
    flagged = t in SPIKES or t == NAN_STEP
    adam_before, adam_after = before.inner_state[1], state.inner_state[1]
    assert (_bits(adam_before) == _bits(adam_after)) == flagged, t
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)) == flagged, t
    assert int(clip_after.norm_count) == int(clip_before.norm_count) + (t != NAN_STEP)
    params = optax.apply_updates(params, updates)
  assert int(state.skipped_count) == len(SPIKES) + 1
  assert int(state.inner_state[1][0].count) == len(_stream()) - len(SPIKES) - 1


def _every_kind_of_state():
  """An optimizer whose state holds every kind of array (a NaN with a payload, signed zeros,
  infinities, bfloat16, int8, bool, complex) and changes every element each step."""
  payload = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
  floats = np.array([payload, -0.0, 0.0, np.inf, 1.5], np.float32)

  def init(params):
    del params
    return {"f32": jnp.asarray(floats), "bf16": jnp.asarray(floats, jnp.bfloat16),
            "i8": jnp.asarray([-128, 0, 127], jnp.int8), "bool": jnp.asarray([True, False]),
            "c64": jnp.asarray([1 - 2j, -0.0 + 0j], jnp.complex64)}

  def update(updates, state, params=None):
    del params
    new = {"f32": -state["f32"], "bf16": -state["bf16"], "i8": state["i8"] + 1,
           "bool": ~state["bool"], "c64": jnp.conj(state["c64"]) + (1 + 1j)}
    return jax.tree.map(lambda u: -u, updates), new

  return optax.GradientTransformation(init, update)


def test_skip_spikes_keeps_every_kind_of_state_bit_for_bit():
  tx = clipjax.skip_spikes(optax.chain(clipjax.andrea_clip(1.0), _every_kind_of_state()))
  params = _params()
  step = jax.jit(tx.update)
  state = tx.init(params)
  kinds = state.inner_state[1]
  updates, state = step(_grads(0), state, params)  # a finite step: every element changes
  for old, new in zip(jax.tree.leaves(kinds), jax.tree.leaves(state.inner_state[1])):
    old, new = np.asarray(old), np.asarray(new)
    per_element = (old.view(np.uint8) != new.view(np.uint8)).reshape(old.size, -1)
    assert per_element.any(axis=1).all(), (old, new)
  assert all(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  before = state
  bad = _grads(1)
  bad["emb"] = bad["emb"].at[3, 3].set(jnp.inf)
  updates, state = step(bad, state, params)  # skipped: every bit stays
  assert _bits(state.inner_state[1]) == _bits(before.inner_state[1])
  assert all(not np.asarray(u).view(np.uint8).any() for u in jax.tree.leaves(updates))
  assert int(state.skipped_count) == 1


def test_skip_spikes_flags_can_be_turned_off():
  tx = _chain("jax", on_spike=False)
  params = _params()
  state = tx.init(params)
  for g in _stream(SPIKES[0] + 1):
    _, state = tx.update(g, state, params)
  assert bool(clipjax.clip_state(state).spike) and int(state.skipped_count) == 0


@pytest.mark.parametrize("impl", ["jax", "ffi"])
def test_no_conditional_in_the_step(impl):
  tx = _chain(impl)
  params = _params()
  hlo = jax.jit(tx.update).lower(_grads(0), tx.init(params), params).compile().as_text()
  ops = set(re.findall(r" (\w[\w-]*)\(", hlo))  # opcodes (and a few other words)
  assert "add" in ops and "conditional" not in ops and "while" not in ops, sorted(ops)


def test_bad_spike_options_name_the_problem():
  with pytest.raises(ValueError, match="z must be a number > 0"):
    clipjax.ZScoreSpike(z=0)
  with pytest.raises(ValueError, match="decay must be in"):
    clipjax.ZScoreSpike(decay=1.0)
  with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
    clipjax.ZScoreSpike(warmup_steps=0)
  with pytest.raises(TypeError, match="spike must be a clipjax.ZScoreSpike"):
    clipjax.andrea_clip(1.0, spike="zscore")
  with pytest.raises(ValueError, match="no AndreaClipState"):
    clipjax.skip_spikes(optax.adamw(1e-3)).init(_params())
  with pytest.raises(ValueError, match="would never skip"):
    clipjax.skip_spikes(optax.chain(clipjax.andrea_clip(1.0)), on_nonfinite=False,
                        on_spike=False)
