"""Who applies the clip's factor: `scale="fused"` (the custom call computes the norm and the
decision, XLA multiplies) and `scale="kernel"` (k_grad_scale writes in place).

The contract, whichever runs: each update is g * scale rounded once to the leaf's dtype,
an unclipped step leaves the gradients bit-identical, and the two give the same bits. It
runs on the default backend: the CPU handler here, the CUDA kernels on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _native

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")

SCALES = ("fused", "kernel")


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _tree(seed, scale=1.0):
  """Mixed dtypes, odd and multi-chunk sizes, an empty leaf."""
  rng = np.random.default_rng(seed)
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  shapes = [(3, 5), (40_000,), (1,), (0,), (70_001,), (8, 8)]
  return {f"p{i}": jnp.asarray(rng.standard_normal(s) * scale, dtypes[i % 3])
          for i, s in enumerate(shapes)}


def _clip(tree, max_norm, scale, **kw):
  return jax.jit(lambda t: clipjax.clip_tree(t, max_norm, impl="ffi", scale=scale, **kw))(tree)


# Trees and max_norms that reach every branch of the decision: an ordinary clip, no clip, a
# factor below float32's normal range (applied as mantissa times a power of two), a norm
# above float32's range, and non-finite norms.
EDGE_CASES = {
    "ordinary": (_tree(0, 3.0), 1.0),
    "not_clipped": (_tree(1), 1e6),
    "tiny_factor": ({"w": jnp.array([1e28, -3e20, 7e5], jnp.float32)}, 1e-12),
    "norm_above_float32": ({"w": jnp.array([3e38, -4.58e-20, 1.0], jnp.float32),
                            "v": jnp.array([2e38], jnp.bfloat16)}, 1e-20),
    "inf_and_huge": ({"a": jnp.array([jnp.inf, 1.0], jnp.float32),
                      "b": jnp.array([1e30], jnp.float32)}, 1.0),
    "nan": ({"a": jnp.array([jnp.nan, 1.0], jnp.float32), "b": jnp.ones(3, jnp.bfloat16)}, 1.0),
}


@pytest.mark.parametrize("on_nonfinite", ["propagate", "zero"])
@pytest.mark.parametrize("mode", ["global", "per_tensor"])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_fused_and_kernel_give_the_same_bits(case, mode, on_nonfinite):
  tree, max_norm = EDGE_CASES[case]
  fused, kernel = (_clip(tree, max_norm, s, mode=mode, on_nonfinite=on_nonfinite)
                   for s in SCALES)
  for k in tree:
    np.testing.assert_array_equal(_bits(fused.updates[k]), _bits(kernel.updates[k]), err_msg=k)
    assert fused.updates[k].dtype == tree[k].dtype
  for a, b in zip((fused.global_norm, fused.clipped, fused.nonfinite),
                  (kernel.global_norm, kernel.clipped, kernel.nonfinite)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scale", SCALES)
def test_updates_are_g_times_the_float32_factor_rounded_once(scale):
  tree = _tree(2, 3.0)
  result = _clip(tree, 1.0, scale)
  factor = np.float32(1.0) / np.float32(result.global_norm)  # the float32 division
  assert bool(result.clipped)
  for k, g in tree.items():
    want = (np.asarray(g, np.float32) * factor).astype(g.dtype)  # exact product, one rounding
    np.testing.assert_array_equal(_bits(result.updates[k]), _bits(want), err_msg=k)


@pytest.mark.parametrize("scale", SCALES)
def test_a_factor_below_float32s_range_is_applied_not_flushed(scale):
  # max_norm / norm = 1e-40, below float32's normal range; every product is a normal float32.
  tree, max_norm = EDGE_CASES["tiny_factor"]
  got = np.asarray(_clip(tree, max_norm, scale).updates["w"], np.float64)
  x = np.asarray(tree["w"], np.float64)
  want = x * (max_norm / np.sqrt(np.sum(x * x)))
  np.testing.assert_allclose(got, want, rtol=2**-23)


@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "lion", "inject_adamw"])
def test_in_a_chain_fused_and_kernel_train_alike(opt):
  """The same decisions and norms, and parameters equal to the last bit or two: fused into
  the optimizer's pass, g * scale may be contracted into a multiply-add by XLA (as optax's
  clip is), where the kernel rounds it first."""
  def make(scale):
    clip = lambda m: clipjax.andrea_clip(m, impl="ffi", scale=scale)  # noqa: E731
    if opt == "inject_adamw":
      return optax.inject_hyperparams(
          lambda max_norm: optax.chain(clip(max_norm), optax.adamw(1e-2)))(max_norm=0.5)
    inner = {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
             "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
             "lion": lambda: optax.lion(1e-3)}[opt]()
    return optax.chain(clip(1.0), inner)

  params = {k: v.astype(jnp.float32) for k, v in _tree(3).items()}
  finals = []
  for scale in SCALES:
    tx = make(scale)
    p, state = params, tx.init(params)

    @jax.jit
    def step(p, state, g):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state
    for seed in (4, 5, 6):
      p, state = step(p, state, {k: v.astype(jnp.float32) for k, v in _tree(seed, 2.0).items()})
    finals.append((p, clipjax.clip_state(state)))
  (p_fused, s_fused), (p_kernel, s_kernel) = finals
  for k in params:
    np.testing.assert_allclose(np.asarray(p_fused[k]), np.asarray(p_kernel[k]), rtol=1e-6,
                               atol=1e-7, err_msg=k)  # 1e-7: a few ulps of a 1e-2 step
  assert float(s_fused.global_norm) == float(s_kernel.global_norm)
  assert bool(s_fused.clipped)


def test_fused_leaves_the_multiply_to_xla():
  """"fused": the custom call has no leaf among its results (nothing aliased, nothing written
  by k_grad_scale); "kernel": every leaf is a result aliased to its operand."""
  tree = _tree(7)
  n = len(tree)
  for scale, aliased in (("fused", 0), ("kernel", n)):
    tx = clipjax.andrea_clip(1.0, impl="ffi", scale=scale)
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree)).as_text()
    calls = [line for line in hlo.splitlines() if "clipjax_andrea_clip" in line]
    assert len(calls) == 1, calls
    assert calls[0].count("output_operand_alias<") == aliased, (scale, calls[0][:400])


@pytest.mark.parametrize("mode,spike", [("global", None), ("per_tensor", None),
                                        ("global", clipjax.ZScoreSpike())])
def test_fused_multiply_reads_the_calls_decision_directly(mode, spike):
  """In the compiled step, the custom call's multipliers are read only by the fusions that
  make the optimizer's leaf-sized results: no kernel of scalars between the call and the
  optimizer (each would cost a launch on the GPU), with a spike policy too."""
  params = {"a": jnp.ones((64, 32)), "b": jnp.ones((128,))}
  tx = optax.chain(clipjax.andrea_clip(1.0, impl="ffi", mode=mode, spike=spike),
                   optax.adamw(1e-3))
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  call = next(line for line in hlo.splitlines() if "clipjax_andrea_clip" in line)
  name = call.split("=", 1)[0].strip()
  # Results: norms, flags, multipliers f32[2, 4], workspace.
  mults = [line.split("=", 1)[0].strip() for line in hlo.splitlines()
           if f"get-tuple-element({name}), index=2" in line]
  assert len(mults) == 1, mults
  readers = [line for line in hlo.splitlines()
             if f"{mults[0]}," in line or f"{mults[0]})" in line]
  assert readers
  for line in readers:
    result_type = line.split("=", 1)[1].split("fusion(")[0]
    assert "[64,32]" in result_type or "[128]" in result_type, line[:300]


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
def test_pure_jax_decision_reaches_the_leaves_as_one_array(mode):
  """The pure-JAX path hands its decision to the leaves' consumers as the custom call does:
  one array of rows (scale, low, high, zero) behind a barrier, no scalars of its own. On a
  GPU, XLA fuses the optimizer's updates of same-shape leaves only then
  (tests/test_gpu.py)."""
  params = {"a": jnp.ones((64, 32)), "b": jnp.ones((128,)), "c": jnp.ones((128,))}
  tx = optax.chain(clipjax.andrea_clip(1.0, impl="jax", mode=mode), optax.adamw(1e-3))
  text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  barriers = [line.rsplit(":", 1)[1] for line in text.splitlines()
              if "stablehlo.optimization_barrier" in line]
  rows = "tensor<3x4xf32>" if mode == "per_tensor" else "tensor<1x4xf32>"
  assert sum(types.strip() == rows for types in barriers) == 1, barriers
  assert not any("tensor<f32>" in types or "tensor<i1>" in types for types in barriers), barriers


def test_auto_is_fused_in_the_transform_and_kernel_in_clip_tree():
  from clipjax import _options
  limit = _options.FUSED_MAX_LEAVES
  resolve = functools.partial(_options.resolve_scale, impl="auto")
  assert resolve("auto", feeds_consumer=True, num_leaves=limit) == "fused"
  assert resolve("auto", feeds_consumer=True, num_leaves=limit + 1) == "kernel"
  assert resolve("auto", feeds_consumer=False, num_leaves=3) == "kernel"
  assert resolve("kernel", feeds_consumer=True, num_leaves=3) == "kernel"
  assert resolve("fused", feeds_consumer=False, num_leaves=10**5) == "fused"
  # The pure-JAX path has no kernel: "auto" is "fused" there, whatever the leaf count.
  for feeds_consumer in (True, False):
    assert _options.resolve_scale("auto", impl="jax", feeds_consumer=feeds_consumer,
                                  num_leaves=limit + 1) == "fused"


def test_impl_jax_clips_trees_above_the_fused_limit(monkeypatch):
  """Above FUSED_MAX_LEAVES, scale="auto" picks the kernel for the custom call only; the
  pure-JAX path clips such trees as any other (the limit is lowered to keep this fast)."""
  from clipjax import _options
  monkeypatch.setattr(_options, "FUSED_MAX_LEAVES", 2)
  tree = [jnp.full((2,), 3.0), jnp.full((3,), 4.0), jnp.full((1,), 12.0)]
  expect = [np.asarray(x) / np.sqrt(18 + 48 + 144) for x in tree]
  tx = clipjax.andrea_clip(1.0, impl="jax")
  out, state = jax.jit(tx.update)(tree, tx.init(tree))
  for got, want in zip(out, expect):
    np.testing.assert_allclose(got, want, rtol=2e-7)
  assert bool(state.clipped)
  for fn in (clipjax.clip_tree, functools.partial(clipjax.clip_tree, scale="auto")):
    result = fn(tree, 1.0, impl="jax")
    np.testing.assert_allclose(result.updates[2], expect[2], rtol=2e-7)


def test_auto_in_the_transform_follows_the_leaf_count():
  """The compiled update of andrea_clip: leaves aliased by k_grad_scale only above
  FUSED_MAX_LEAVES."""
  from clipjax import _options
  for n, aliased in ((3, False), (_options.FUSED_MAX_LEAVES + 1, True)):
    tree = [jnp.ones((2,), jnp.float32) for _ in range(n)]
    tx = clipjax.andrea_clip(1.0, impl="ffi")
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree)).as_text()
    assert ("output_operand_alias<" in hlo) == aliased, n


def test_bad_scale_options_name_the_problem():
  with pytest.raises(ValueError, match="scale must be one of"):
    clipjax.andrea_clip(1.0, scale="inplace")
  with pytest.raises(ValueError, match="impl='jax' always leaves the multiply to XLA"):
    clipjax.clip_tree({"w": jnp.ones(3)}, 1.0, impl="jax", scale="kernel")
