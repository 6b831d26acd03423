"""The CUDA custom call on a GPU: the same specification, plus what only a GPU
can show (huge leaves, thousands of leaves, run-to-run bit identity). Skipped,
with the reason, where no CUDA device or no CUDA handler is present."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _native
from conftest import f64_norm, has_cuda, random_tree

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_cuda(), reason="no CUDA device visible to JAX"),
    pytest.mark.skipif(not _native.has_handler("cuda"),
                       reason="clipjax was built without the CUDA custom call (no nvcc)"),
]


def gpt_shapes(vocab=8449, d=768, layers=12, ctx=1024):
  shapes = [(vocab, d), (ctx, d)]
  for _ in range(layers):
    shapes += [(d,), (d,)]                      # ln1
    shapes += [(d, d), (d,)] * 4                # q, k, v, o
    shapes += [(d,), (d,)]                      # ln2
    shapes += [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]
  shapes += [(d,), (d,), (d, vocab)]            # final ln, lm head
  return shapes


FIVE_THOUSAND_SHAPES = [((i * 7919) % 300,) for i in range(5000)]


def numpy_tree(key, shapes):
  """float32 standard normals drawn by NumPy and put on the device as they are: JAX's
  draws compile once per shape, minutes for the 300 shapes of the 5,000-leaf tree."""
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
  return {f"p{i}": jax.device_put(rng.standard_normal(s, np.float32))
          for i, s in enumerate(shapes)}


TREES = {
    "gpt12m_f32": lambda k: random_tree(k, gpt_shapes(d=384, layers=6), jnp.float32, 0.01),
    "gpt12m_bf16": lambda k: random_tree(k, gpt_shapes(d=384, layers=6), jnp.bfloat16, 0.01),
    "one_leaf": lambda k: random_tree(k, [(1234567,)], jnp.float32, 1.0),
    "five_thousand_leaves": lambda k: numpy_tree(k, FIVE_THOUSAND_SHAPES),
    "odd_sizes": lambda k: random_tree(
        k, [(1,), (3,), (7,), (32767,), (32769,), (65535,), (0,), (5, 0), (99991,)],
        jnp.float16, 1.0),
    "mixed": lambda k: {"f32": random_tree(k, [(1000, 3)], jnp.float32),
                        "bf16": random_tree(k, [(33333,)], jnp.bfloat16),
                        "f16": random_tree(k, [(4097,)], jnp.float16)},
    "huge_values": lambda k: random_tree(k, [(100000,), (17,)], jnp.float32, 1e30),
    "tiny_values": lambda k: random_tree(k, [(100000,), (17,)], jnp.float32, 1e-30),
    "bf16_huge_values": lambda k: random_tree(k, [(4099,)], jnp.bfloat16, 1e36),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_norm_matches_float64_reference(name):
  tree = TREES[name](jax.random.key(len(name)))
  ref = f64_norm(tree)
  got = float(jax.jit(lambda t: clipjax.global_norm(t, impl="ffi"))(tree))
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  res = _donated_clip("auto")(_copy(tree))
  np.testing.assert_allclose(float(res.global_norm), ref, rtol=1e-6)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _donated_clip(impl, **kw):
  # Donated, as gradients are inside a training step: a non-donated input makes
  # XLA copy every leaf before the in-place custom call (one small kernel per
  # leaf, which for thousands of leaves also costs minutes of compile time).
  return jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl=impl, **kw), donate_argnums=0)


# The pure-JAX path's compile of 5,000 leaves takes minutes (docs/guide.md, "Limits"): that tree is
# checked against float64 on its own, below.
@pytest.mark.parametrize("name", sorted(set(TREES) - {"five_thousand_leaves"}))
def test_outputs_match_pure_jax_within_one_ulp_of_the_scale(name):
  tree = TREES[name](jax.random.key(7 + len(name)))
  tree = jax.tree.map(lambda x: x * 50 if x.dtype != jnp.float16 else x, tree)
  a = _donated_clip("ffi")(_copy(tree))
  b = _donated_clip("jax")(_copy(tree))
  assert bool(a.clipped) == bool(b.clipped)
  assert bool(a.nonfinite) == bool(b.nonfinite) == False  # noqa: E712
  na, nb = float(a.global_norm), float(b.global_norm)
  np.testing.assert_allclose(na, nb, rtol=1e-6)
  # The custom call sums squares in float64, the pure-JAX path in float32: their norms,
  # so their scales, differ by this much (0 where both are inf: the norm is above the
  # float32 range and each path scales by max_norm / norm from its rescaled sum).
  norm_diff = abs(na - nb) / nb if math.isfinite(nb) else 0.0
  for x, y in zip(jax.tree.leaves(a.updates), jax.tree.leaves(b.updates)):
    assert x.dtype == y.dtype
    ulp = float(jnp.finfo(x.dtype).eps)
    # Beyond the scales' difference: one ulp of the scale for float32 leaves; for
    # 16-bit leaves the rounding of the product to the leaf type may differ by one ulp
    # of that type, which below its normal range is the spacing of its subnormals (an
    # absolute step: 2**-24 in float16); bf16_huge_values' factor is subnormal on the
    # GPU (about 17 bits).
    rtol = norm_diff + max(2.4e-7 if math.isfinite(nb) else 1e-5, ulp)
    atol = float(jnp.finfo(x.dtype).smallest_subnormal) if ulp > 1e-6 else 1e-30
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=rtol, atol=atol)


def test_five_thousand_leaves_are_scaled_as_in_float64():
  # By k_grad_scale, as clip_tree and andrea_clip scale a tree of this many leaves.
  tree = numpy_tree(jax.random.key(12), FIVE_THOUSAND_SHAPES)
  norm = f64_norm(tree)
  res = _donated_clip("ffi")(_copy(tree))
  np.testing.assert_allclose(float(res.global_norm), norm, rtol=1e-6)
  assert bool(res.clipped) and norm > 100
  got, want = jax.device_get((res.updates, tree))
  for k, x in want.items():
    # Two ulps, as in test_many_leaves: the norm's rounding to float32 and the product's.
    np.testing.assert_allclose(np.asarray(got[k], np.float64),
                               np.asarray(x, np.float64) / norm, rtol=2 * 2.0**-23, atol=1e-30,
                               err_msg=k)


def test_gpt120m_clip_matches_reference_and_optax():
  tree = random_tree(jax.random.key(0), gpt_shapes(), jnp.float32, 0.01)
  ref = f64_norm(tree)
  res = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="auto"))(tree)
  np.testing.assert_allclose(float(res.global_norm), ref, rtol=1e-6)
  opt = optax.clip_by_global_norm(1.0)
  expected, _ = jax.jit(opt.update)(tree, opt.init(tree))
  for x, y in zip(jax.tree.leaves(res.updates), jax.tree.leaves(expected)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-12)


def test_unclipped_step_is_bit_for_bit():
  tree = random_tree(jax.random.key(1), gpt_shapes(d=384, layers=6), jnp.bfloat16, 1e-5)
  res = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi"))(tree)
  assert not bool(res.clipped)
  for x, y in zip(jax.tree.leaves(res.updates), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))


def test_leaf_larger_than_2_to_the_31_elements():
  n = 2**31 + 3
  bf16 = jnp.bfloat16
  # 3.0, ones, then three 2.0s: the sum of squares is known exactly. Built by concatenation
  # and read back with static slices inside jit: without x64, JAX's own indexing (.at[],
  # x[i]) converts indices to int32 and cannot reach past 2**31.
  x = jnp.concatenate([jnp.full((1,), 3.0, bf16), jnp.ones((n - 4,), bf16),
                       jnp.full((3,), 2.0, bf16)])
  expected = math.sqrt((n - 4) * 1.0 + 9.0 + 3 * 4.0)
  f = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi"), donate_argnums=0)
  res = f({"x": x})
  np.testing.assert_allclose(float(res.global_norm), expected, rtol=1e-7)
  assert bool(res.clipped) and not bool(res.nonfinite)
  # n - 3 == 2**31: the 2.0s start exactly at the first index past the int32 range.
  where = [(0, 3.0), (1, 1.0), (2**31 - 2, 1.0), (2**31 - 1, 1.0), (2**31, 2.0),
           (2**31 + 1, 2.0), (n - 1, 2.0)]
  picked = jax.jit(lambda y: jnp.concatenate(
      [jax.lax.slice_in_dim(y, i, i + 1) for i, _ in where]))(res.updates["x"])
  scale = np.float32(1.0) / np.float32(expected)
  want = np.array([v * scale for _, v in where], np.float32)
  want = np.asarray(jnp.asarray(want).astype(bf16), np.float32)
  np.testing.assert_array_equal(np.asarray(picked, np.float32), want)
  # Every element was scaled once: the clipped leaf has norm max_norm (bf16 rounding).
  np.testing.assert_allclose(float(clipjax.global_norm(res.updates, impl="ffi")), 1.0,
                             rtol=4e-3)
  del res, picked


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite(bad):
  tree = random_tree(jax.random.key(2), [(70000,), (100,)], jnp.float32)
  tree["p0"] = tree["p0"].at[65536].set(bad)
  prop = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi"))(tree)
  ref_tx = optax.clip_by_global_norm(1.0)
  ref, _ = ref_tx.update(tree, ref_tx.init(tree))
  for x, y in zip(jax.tree.leaves(prop.updates), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(x, y)
  zero = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", on_nonfinite="zero"))(tree)
  assert bool(zero.nonfinite)
  for x in jax.tree.leaves(zero.updates):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint32), 0)


def test_per_tensor_mode_matches_pure_jax():
  tree = random_tree(jax.random.key(3), [(50000,), (300,), (7, 7)], jnp.float32, 0.02)
  a = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", mode="per_tensor"))(tree)
  b = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax", mode="per_tensor"))(tree)
  np.testing.assert_allclose(np.array(a.leaf_norms), np.array(b.leaf_norms), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(a.updates), jax.tree.leaves(b.updates)):
    np.testing.assert_allclose(x, y, rtol=2.4e-7)


def test_hundred_runs_are_bit_identical():
  tree = random_tree(jax.random.key(4), gpt_shapes(d=384, layers=6), jnp.bfloat16, 0.05)
  f = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi"))
  first = f(tree)
  first_bits = [np.asarray(x).view(np.uint16) for x in jax.tree.leaves(first.updates)]
  norm_bits = np.asarray(first.global_norm).view(np.uint32)
  for _ in range(100):
    again = f(tree)
    assert np.asarray(again.global_norm).view(np.uint32) == norm_bits
  for x, bits in zip(jax.tree.leaves(again.updates), first_bits):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint16), bits)


def test_donated_adamw_chain_step_matches_pure_jax():
  shapes = gpt_shapes(d=384, layers=2, vocab=1000, ctx=128)
  params = random_tree(jax.random.key(5), shapes, jnp.float32, 0.02)

  def run(impl):
    tx = optax.chain(clipjax.andrea_clip(1.0, impl=impl), optax.adamw(3e-4, weight_decay=0.1))

    @jax.jit
    def grads_of(p, i):
      return jax.tree.map(lambda x: jnp.sin(x * (i + 1.0)) * 0.3, p)

    def step(p, s, i):
      u, s = tx.update(grads_of(p, i), s, p)
      return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    norms = []
    for i in range(20):
      p, s = step(p, s, float(i))
      norms.append(float(clipjax.clip_state(s).global_norm))
    return p, np.array(norms)

  p_ffi, n_ffi = run("ffi")
  p_jax, n_jax = run("jax")
  np.testing.assert_allclose(n_ffi, n_jax, rtol=1e-6)
  for x, y in zip(jax.tree.leaves(p_ffi), jax.tree.leaves(p_jax)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def _update_kernels(tx, params, shape):
  """(all fusions, loop fusions with a result of `shape`) in the compiled step of `tx`,
  its gradients an intermediate (a traced loss scale times the argument)."""
  def step(p, s, g, loss_scale):
    g = jax.tree.map(lambda x: (x * loss_scale).astype(x.dtype), g)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  hlo = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, tx.init(params), params, np.float32(1.0)).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):].splitlines()
  fusions = [line for line in entry if " fusion(" in line]
  result = f"bf16[{','.join(map(str, shape))}]"
  return len(fusions), sum(1 for line in fusions if "kind=kLoop" in line
                           and result in line.split("fusion(")[0])


def test_pure_jax_clip_lets_xla_fuse_the_optimizers_updates_across_leaves():
  """The pure-JAX path's decision reaches the leaves as one array: XLA still fuses AdamW's
  updates of same-shape leaves into a kernel or a few, as for AdamW alone. (With the
  decision's four values as four arrays, each leaf's update was a kernel of its own.)"""
  shapes = gpt_shapes(d=384, layers=6, vocab=1000, ctx=128)
  params = random_tree(jax.random.key(6), shapes, jnp.bfloat16, 0.02)
  same = sum(1 for s in shapes if s == (384,))
  adamw = optax.adamw(1e-4, weight_decay=0.1)
  alone = _update_kernels(adamw, params, (384,))
  clipped = _update_kernels(optax.chain(clipjax.andrea_clip(1.0, impl="jax"), adamw),
                            params, (384,))
  assert clipped[1] <= alone[1] + 2 and clipped[1] < same // 4, (
      f"{same} leaves of (384,): loop fusions with such a result, adamw alone {alone[1]},"
      f" with the clip {clipped[1]}; all fusions {alone[0]} and {clipped[0]}")


def test_auto_lowers_to_the_custom_call_on_cuda():
  tree = random_tree(jax.random.key(6), [(100,)], jnp.float32)
  text = jax.jit(lambda t: clipjax.clip_tree(t, 1.0)).lower(tree).as_text()
  assert "clipjax_andrea_clip" in text


# The same clips with the early launch of the final and scale kernels turned off
# (CLIPJAX_PDL=0, read once per process): the results must not change by one bit.
_PDL_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import clipjax
sys.path.insert(0, sys.argv[2])
from conftest import random_tree
shapes = [((i * 7919) % 70000 + 1,) for i in range(40)]  # 1 to 3 chunks each
out = {}
for dtype in (jnp.float32, jnp.bfloat16):
  tree = random_tree(jax.random.key(7), shapes, dtype, 0.05)
  for mode in ("global", "per_tensor"):
    f = jax.jit(lambda t, m: clipjax.clip_tree(t, m, impl="ffi", mode=mode))
    for max_norm in (0.5, 1e6):  # clips / does not clip
      r = f(tree, max_norm)
      key = f"{jnp.dtype(dtype).name}-{mode}-{max_norm}"
      out[key + "-norm"] = np.asarray(r.global_norm)
      out[key + "-leaf-norms"] = np.asarray(r.leaf_norms)
      for i, x in enumerate(jax.tree.leaves(r.updates)):
        out[f"{key}-{i}"] = np.asarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)
np.savez(sys.argv[1], **out)
"""


def test_results_do_not_depend_on_the_early_kernel_launch(tmp_path):
  here = os.path.dirname(os.path.abspath(__file__))
  runs = {}
  for value in ("1", "0"):
    path = tmp_path / f"pdl{value}.npz"
    proc = subprocess.run([sys.executable, "-c", _PDL_SCRIPT, str(path), here],
                          env=dict(os.environ, CLIPJAX_PDL=value), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs[value] = np.load(path)
  on, off = runs["1"], runs["0"]
  assert len(on.files) == 8 * (2 + 40)
  assert sorted(on.files) == sorted(off.files)
  for key in on.files:
    np.testing.assert_array_equal(on[key], off[key], err_msg=key)
