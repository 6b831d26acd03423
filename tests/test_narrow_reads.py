"""The custom call's norms read a leaf that the same jit converted in a cheaper source
(`_trace_reads.norm_sources`), which XLA would otherwise write out for the call:
- a float32 leaf widened from bfloat16 or float16 in its narrow form (the gradients of a
  model with bfloat16 compute and float32 parameters);
- a bfloat16 or float16 leaf narrowed from a float32 array in memory (a reduction's
  result: the LayerNorms' gradients summed in float32) as that array, each value
  rounded in the kernel as the conversion rounds it.
The norms, the clipped leaves and the derivative are those of the leaves. It runs on the
default backend: the CPU handler here, the CUDA kernels on a GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _native
from conftest import direct_clip_call

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")


@pytest.fixture(autouse=True)
def _one_device():
  """The narrow reads are a single device's: where there are devices to split over, the
  partitioned call reads the leaves (docs/design.md, "Narrow reads")."""
  if jax.device_count() != 1:
    pytest.skip(f"the narrow reads are a single device's; this process sees {jax.device_count()}")

SHAPES = [(64, 48), (48,), (7, 5, 3), (9, 4), (70_001,)]
NARROW = (jnp.bfloat16, jnp.float16, jnp.bfloat16, None, jnp.float16)  # None: float32


def _inputs(seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  # float16's range is narrow: its leaves keep their scale.
  return [jnp.asarray(rng.standard_normal(s) * (3.0 if d == jnp.float16 else scale),
                      d or jnp.float32) for s, d in zip(SHAPES, NARROW)]


def _widened(xs):
  """The tree the clip sees: float32 leaves, all but one widened inside the jit."""
  return [x.astype(jnp.float32) if x.dtype != jnp.float32 else x * 2 for x in xs]


def _clip(xs, **kwargs):
  return clipjax.clip_tree(_widened(xs), 1.0, **kwargs)


def _calls(text):
  return [line for line in text.splitlines() if "@clipjax_andrea_clip(" in line]


def _call_operand_types(text):
  """Each clip custom call's leaf operand types, as `tensor<...>` strings."""
  return [re.findall(r"tensor<[^>]*>", c.rsplit(" : (", 1)[1].split(") ->")[0])[1:]
          for c in _calls(text)]


def _read_as(text):
  """Each clip custom call's `read_as` attribute, as a list of ints."""
  return [[int(v) for v in re.search(r"read_as = (?:dense<\[?|array<i64: )([-0-9, ]*)", c)
           .group(1).split(",")] for c in _calls(text)]


def test_the_norms_read_the_narrow_arrays_and_the_kernel_scale_the_float32_leaves():
  xs = _inputs()
  want = ["tensor<64x48xbf16>", "tensor<48xf16>", "tensor<7x5x3xbf16>", "tensor<9x4xf32>",
          "tensor<70001xf16>"]
  fused = jax.jit(lambda xs: _clip(xs, impl="ffi", scale="fused")).lower(xs)
  norm = jax.jit(lambda xs: clipjax.global_norm(_widened(xs), impl="ffi")).lower(xs)
  assert _call_operand_types(fused.as_text()) == [want]
  assert _call_operand_types(norm.as_text()) == [want]
  # The kernel that writes the leaves in place reads them as they are (clip_tree's "auto").
  text = jax.jit(lambda xs: _clip(xs, impl="ffi")).lower(xs).as_text()
  assert all("f32" in t for t in _call_operand_types(text)[0])


def test_more_leaves_than_one_call_takes():
  """Above `_ffi.MAX_LEAVES_PER_CALL` leaves the norms run in several calls, each reading
  the narrow arrays, and the clip is that of the float32 leaves."""
  xs = [jnp.full((3 + i % 4,), 1 + i % 7, jnp.bfloat16) for i in range(300)]
  fn = jax.jit(lambda xs: clipjax.andrea_clip(1.0, impl="ffi").update(
      [x.astype(jnp.float32) for x in xs], clipjax.andrea_clip(1.0).init(xs))[0])
  types = _call_operand_types(fn.lower(xs).as_text())
  assert len(types) == 2 and all(t.endswith("xbf16>") for call in types for t in call)
  want = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="jax").updates)(
      [x.astype(jnp.float32) for x in xs])
  for g, w in zip(fn(xs), want):
    np.testing.assert_allclose(g, w, rtol=4e-7)


def test_leaves_passed_to_the_jit_are_read_as_they_are():
  leaves = _widened(_inputs())
  text = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi")).lower(leaves).as_text()
  assert all("f32" in t for t in _call_operand_types(text)[0])


@pytest.mark.parametrize("scale_factor", [3.0, 1e-30, 1e25])
def test_results_are_those_of_the_float32_leaves(scale_factor):
  """Against the same float32 leaves passed to the jit (read as float32): the same norms
  within float32 rounding, the same clipped leaves, across the float range."""
  xs = _inputs(1, scale_factor)
  got = jax.jit(lambda xs: _clip(xs, impl="ffi", scale="fused"))(xs)
  leaves = jax.jit(_widened)(xs)
  want = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", scale="fused"))(leaves)
  np.testing.assert_allclose(got.global_norm, want.global_norm, rtol=2e-7)
  np.testing.assert_allclose(got.leaf_norms, want.leaf_norms, rtol=2e-7)
  assert bool(got.clipped) == bool(want.clipped)
  for g, w in zip(got.updates, want.updates):
    np.testing.assert_allclose(g, w, rtol=4e-7, atol=0)


def test_derivative_and_vmap():
  """The derivative (which takes no account of the narrow reads) matches the pure-JAX
  clip's; under vmap the leaves are read as they are, once per batch element."""
  xs = _inputs(2)

  def summed(impl):
    return jax.jit(jax.grad(lambda xs: sum(jnp.sum(u) for u in _clip(xs, impl=impl).updates)))

  for a, b in zip(summed("ffi")(xs), summed("jax")(xs)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-2, atol=1e-6)
  batched = [jnp.stack([x, 2 * x]) for x in xs]
  norms = jax.jit(jax.vmap(lambda xs: _clip(xs, impl="ffi").global_norm))(batched)
  one = jax.jit(lambda xs: _clip(xs, impl="ffi").global_norm)(xs)
  np.testing.assert_allclose(norms, [one, 2 * one], rtol=2e-7)


def test_auto_lowered_for_cuda_reads_the_narrow_arrays(monkeypatch):
  """impl="auto" lowered for CUDA (here without a GPU): `andrea_clip` ahead of adamw, in a
  step whose model computes in bfloat16, reads the parameters' bfloat16 gradients."""
  monkeypatch.setattr(_native, "cuda_usable", lambda: True)
  params = {"w": jnp.ones((32, 16)), "b": jnp.zeros((16,))}
  tx = optax.chain(clipjax.andrea_clip(1.0), optax.adamw(1e-3))

  def step(params, opt_state, x):
    def loss(p):
      y = x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16) + p["b"].astype(jnp.bfloat16)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  text = jax.jit(step).trace(params, tx.init(params), jnp.ones((4, 32))).lower(
      lowering_platforms=("cuda",)).as_text()
  (types,) = _call_operand_types(text)
  assert sorted(types) == ["tensor<16xbf16>", "tensor<32x16xbf16>"]


# Values that bfloat16 and float16 round: the narrowed leaves differ from their sources.
def _sources(a):
  """The float32 arrays the leaves of `_narrowed` are converted from: reductions, the
  argument, and an elementwise product (not in memory: the call reads that leaf)."""
  return [jnp.sum(a, axis=0), jnp.sum(a * 9.7, axis=0), jnp.max(a, axis=0), a, a[3:6] * 1.1]


# Each leaf's conversion, and the narrowest type in it.
_NARROWING = [(lambda x: x.astype(jnp.bfloat16), jnp.bfloat16),
              (lambda x: x.reshape(10, 10).astype(jnp.float16), jnp.float16),
              (lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), jnp.bfloat16),
              (lambda x: x.astype(jnp.float16), jnp.float16),
              (lambda x: x.astype(jnp.bfloat16), jnp.bfloat16)]


def _narrowed(sources):
  """The tree the clip sees: leaves narrowed from float32 arrays (one through a reshape,
  one widened back to float32)."""
  return [narrow(x) for (narrow, _), x in zip(_NARROWING, sources)]


def _f32_sums(seed=3, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((64, 100)) * scale * (1 + 2.0**-12), jnp.float32)


def test_the_norms_read_narrowed_leaves_as_their_float32_sources_rounded():
  a = _f32_sums()
  text = jax.jit(lambda a: clipjax.clip_tree(_narrowed(_sources(a)), 1.0, impl="ffi",
                                             scale="fused")
                 ).lower(a).as_text()
  assert _call_operand_types(text) == [["tensor<100xf32>", "tensor<10x10xf32>",
                                        "tensor<100xf32>", "tensor<64x100xf32>",
                                        "tensor<3x100xbf16>"]]
  assert _read_as(text) == [[1, 2, 1, 2, 0]]  # bfloat16, float16, bfloat16, float16, as stored


def test_a_source_inside_a_nested_jit_is_read_rounded():
  """JAX wraps some equations in a jit of their own, as the scatter-add that differentiates
  an indexing (a bfloat16 embedding's gradient, summed in float32): the source is looked
  for inside it. An elementwise product there is not in memory, and is read as the leaf."""
  a = _f32_sums()
  table = jnp.asarray(np.random.default_rng(5).standard_normal((10, 100)), jnp.bfloat16)
  rows = jnp.array([1, 5, 1, 7])
  product = jax.jit(lambda a: a * 1.1)

  def leaves(table, a):
    grad = jax.grad(lambda t: jnp.sum(jnp.take(t.astype(jnp.float32), rows, axis=0) * a[:4]))
    return [grad(table), product(a).astype(jnp.bfloat16)]

  norm = jax.jit(lambda table, a: clipjax.global_norm(leaves(table, a), impl="ffi"))
  text = norm.lower(table, a).as_text()
  assert _call_operand_types(text) == [["tensor<10x100xf32>", "tensor<64x100xbf16>"]]
  assert _read_as(text) == [[1, 0]]
  want = jax.jit(lambda t: clipjax.global_norm(t, impl="ffi"))(jax.jit(leaves)(table, a))
  np.testing.assert_allclose(norm(table, a), want,
                             rtol=0 if jax.default_backend() == "cpu" else 2.0**-23)


@pytest.mark.parametrize("scale", [1.0, 1e-6, 3e3])
def test_rounded_reads_give_the_narrowed_leaves_norms(scale):
  """Against the same narrow leaves passed to the jit (read as they are): the same norms
  within float32 rounding (the CUDA kernel sums a float32 source four elements to a load,
  a narrow leaf eight, so their float64 sums may round apart; on a CPU they are the same
  bits), and the same clipped leaves within one rounding of their type (one step where
  the update is subnormal in it). At 3e3 some float16 sums overflow to inf, as the
  conversion makes them, and the clip sees a leaf that is not finite.

  The reference narrows, op by op, the float32 arrays that the jit computed: in one jit,
  XLA on a GPU may sum in another order than alone (its reductions' rounding may differ),
  and may drop the float32-bfloat16-float32 round trip of the third leaf where it feeds
  the multiply (it allows excess precision), whose result then holds the values before
  the rounding; the norms take the values the program states. For the same reason the
  updates are compared only where the norm is finite."""
  a = _f32_sums(4, scale)

  def clipped(a):
    sources = _sources(a)
    return clipjax.clip_tree(_narrowed(sources), 1.0, impl="ffi", scale="fused"), sources

  got, sources = jax.jit(clipped)(a)
  want = jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi", scale="fused"))(
      _narrowed(sources))
  exact = jax.default_backend() == "cpu"
  for g, w in ((got.leaf_norms, want.leaf_norms), (got.global_norm, want.global_norm)):
    np.testing.assert_allclose(g, w, rtol=0 if exact else 2.0**-23)
  assert bool(got.clipped) == bool(want.clipped)
  assert bool(np.isfinite(got.global_norm)) == (scale < 1e3)
  if not np.isfinite(want.global_norm):
    return  # the updates are NaN where XLA kept the overflow, and 0 where it dropped it
  for g, w, (_, narrowest) in zip(got.updates, want.updates, _NARROWING):
    # One rounding of the narrowest type: relative where the update is normal in it, one
    # subnormal step below that (float16's are 2**-24 apart).
    info = jnp.finfo(narrowest)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=0 if exact else float(info.eps),
                               atol=0 if exact else float(info.smallest_subnormal))


def test_more_leaves_than_one_call_takes_read_rounded():
  """Above `_ffi.MAX_LEAVES_PER_CALL` leaves every norm call reads its float32 sources
  (the reference as in `test_rounded_reads_give_the_narrowed_leaves_norms`)."""
  def norm(a):
    sums = [jnp.sum(a * (1 + i / 300), axis=0) for i in range(300)]
    return clipjax.global_norm([x.astype(jnp.bfloat16) for x in sums], impl="ffi"), sums

  a = _f32_sums(5)
  assert [set(r) for r in _read_as(jax.jit(norm).lower(a).as_text())] == [{1}, {1}]
  got, sums = jax.jit(norm)(a)
  want = jax.jit(lambda t: clipjax.global_norm(t, impl="ffi"))(
      [x.astype(jnp.bfloat16) for x in sums])
  np.testing.assert_allclose(got, want, rtol=0 if jax.default_backend() == "cpu" else 2.0**-23)


@pytest.mark.parametrize("operands, read_as, message", [
    ([jnp.ones(4, jnp.bfloat16)], [1], "leaf 0 is read rounded, which takes a float32"),
    ([jnp.ones(4), jnp.ones(3)], [1], "read_as has 1 values for 2 leaves"),
    ([jnp.ones(4)], [7], "read_as of leaf 0 must be 0 (as stored), 1 (rounded to bfloat16)"),
])
def test_the_handler_names_a_bad_read_as(operands, read_as, message):
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU handler's check; the CUDA handler decodes the same way")
  with pytest.raises(Exception, match=re.escape(message)):
    jax.block_until_ready(direct_clip_call(operands, read_as=read_as))
