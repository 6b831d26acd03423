"""The custom call's norms read the weight gradients of matmuls that share an input (a
transformer's q, k and v) as blocks of columns of one array (`_trace_reads.norm_sources`):
XLA's GPU compiler computes them as one merged matmul and would otherwise write each
leaf out as a copy of its block for the call. The norms and the clipped leaves are those
of the leaves. It runs on the default backend: the CPU handler here, the CUDA kernels on a
GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _native, _trace_reads
from conftest import direct_clip_call

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")


@pytest.fixture(autouse=True)
def _one_device():
  """Like the narrow reads, the column reads are a single device's (docs/design.md)."""
  if jax.device_count() != 1:
    pytest.skip(f"the column reads are a single device's; this process sees {jax.device_count()}")


def _loss(p, x):
  """Three dense layers of one input (q, k, v), a fourth of another input (o)."""
  x = x.astype(p["q"].dtype)
  h = x @ p["q"] + jnp.tanh(x @ p["k"]) * (x @ p["v"])
  return jnp.sum(jnp.square(h.astype(jnp.float32))) + jnp.sum(jnp.square(
      jnp.tanh(h) @ p["o"]).astype(jnp.float32))


def _model(seed=0, dtype=jnp.float32, d=64, width=48, rows=32):
  keys = jax.random.split(jax.random.key(seed), 5)
  p = {n: jax.random.normal(k, (width if n == "o" else d, width), jnp.float32).astype(dtype)
       for n, k in zip("qkvo", keys)}
  return p, jax.random.normal(keys[4], (rows, d))


def _step(opt):
  def step(p, s, x):
    updates, s = opt.update(jax.grad(_loss)(p, x), s, p)
    return optax.apply_updates(p, updates), s
  return jax.jit(step)


def _calls(text):
  return [line for line in text.splitlines() if "@clipjax_andrea_clip(" in line]


def _columns(text):
  """Each clip custom call's `columns` attribute, as (first, width) pairs."""
  out = []
  for c in _calls(text):
    values = re.search(r"columns = (?:dense<\[?|array<i64: )([-0-9, ]*)", c).group(1).split(",")
    flat = [int(v) for v in values] * (1 if len(values) > 1 else 2)  # a splat: one value
    out.append(list(zip(flat[0::2], flat[1::2])))
  return out


def _ungrouped(monkeypatch):
  monkeypatch.setattr(_trace_reads, "_merged_matmuls", lambda arrays, read_as: [])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_k_v_gradients_are_read_as_columns_of_one_array(dtype):
  p, x = _model(dtype=dtype)
  opt = optax.chain(clipjax.andrea_clip(1.0, impl="ffi"), optax.adamw(1e-3))
  text = _step(opt).lower(p, opt.init(p), x).as_text()
  # The leaves in tree order are k, o, q, v; the concatenation holds k, q, v in that order.
  assert _columns(text) == [[(0, 48), (0, 0), (48, 48), (96, 48)]]
  assert re.search(rf"tensor<64x144x{'f32' if dtype == jnp.float32 else 'bf16'}>",
                   _calls(text)[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_results_are_those_of_the_leaves_read_whole(dtype, monkeypatch):
  """Rows of whole 16-byte vectors are summed in the order the whole leaf is: the same
  norms and steps, to the bit, with and without the column reads."""
  p, x = _model(1, dtype)
  opt = optax.chain(clipjax.andrea_clip(1.0, impl="ffi"), optax.adamw(1e-3))
  got = _step(opt)(p, opt.init(p), x)
  _ungrouped(monkeypatch)
  want = _step(opt)(p, opt.init(p), x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  norms = clipjax.clip_state(got[1]).leaf_norms
  ref = jax.jit(lambda p, x: clipjax.clip_tree(jax.grad(_loss)(p, x), 1.0,
                                               impl="jax").leaf_norms)(p, x)
  np.testing.assert_allclose(norms, ref, rtol=4e-7)


def test_the_global_norm_alone_reads_columns_too():
  p, x = _model(2)
  fn = jax.jit(lambda p, x: clipjax.global_norm(jax.grad(_loss)(p, x), impl="ffi"))
  assert _columns(fn.lower(p, x).as_text()) == [[(0, 48), (0, 0), (48, 48), (96, 48)]]
  g = jax.jit(jax.grad(_loss))(p, x)
  want = np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64))) for v in g.values()))
  np.testing.assert_allclose(fn(p, x), want, rtol=2e-7)


def _grouped(fn, *args):
  """Whether a clip call in fn's program reads columns (traced anew: jit caches traces)."""
  text = jax.jit(lambda *a: fn(*a)).lower(*args).as_text()
  return any(w for call in _columns(text) for _, w in call)


def test_where_the_leaves_are_read_whole(monkeypatch):
  """No columns where XLA would not merge the matmuls or the call would read slowly: above
  XLA's merge limit, rows that are not whole 16-byte vectors, inputs not shared; and where
  the leaves' matmuls are not in the trace (arguments of the jit) or the kernel writes them."""
  norm = lambda p, x: clipjax.global_norm(jax.grad(_loss)(p, x), impl="ffi")  # noqa: E731
  p, x = _model()
  assert _grouped(norm, p, x)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dot_merger_threshold_mb=64 "
                     "--xla_gpu_dot_merger_threshold_mb=0")
  assert _trace_reads.dot_merger_limit() == 0
  assert not _grouped(norm, p, x)
  monkeypatch.delenv("XLA_FLAGS")
  assert _trace_reads.dot_merger_limit() == 32 << 20
  assert not _grouped(norm, *_model(width=5))  # 20-byte rows
  assert _grouped(norm, *_model(width=4))  # 16-byte rows
  separate = lambda p, x: clipjax.global_norm(  # noqa: E731
      jax.grad(lambda p: jnp.sum(jnp.square((x @ p["q"]) * ((2 * x) @ p["k"]))))(p), impl="ffi")
  assert not _grouped(separate, p, x)
  g = jax.jit(jax.grad(_loss))(p, x)
  assert not _grouped(lambda g: clipjax.global_norm(g, impl="ffi"), g)
  assert not _grouped(lambda p, x: clipjax.clip_tree(jax.grad(_loss)(p, x), 1.0, impl="ffi",
                                                     scale="kernel").updates, p, x)


def test_merge_limit_counts_what_the_matmul_reads_and_writes(monkeypatch):
  """XLA merges a matmul that reads and writes at most the limit: here 32 rows of 64 inputs
  and the output's gradient, 48 wide, and the 64 x 48 result, float32."""
  p, x = _model()
  norm = lambda p, x: clipjax.global_norm(jax.grad(_loss)(p, x), impl="ffi")  # noqa: E731
  size = 4 * (32 * 64 + 32 * 48 + 64 * 48)
  monkeypatch.setattr(_trace_reads, "dot_merger_limit", lambda: size)
  assert _grouped(norm, p, x)
  monkeypatch.setattr(_trace_reads, "dot_merger_limit", lambda: size - 1)
  assert not _grouped(norm, p, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows, cols, blocks", [
    (96, 288, [(0, 96), (96, 96), (192, 96)]),  # whole vectors
    (1000, 96, [(0, 40), (40, 56)]),             # widths of 40 and 56: whole bf16 vectors only
    (3, 50, [(1, 7), (8, 42)]),                  # nothing aligned
    (70_000, 16, [(0, 8), (8, 8)]),              # many chunks, narrow rows
    (5, 24, [(0, 24)]),                          # every column: read whole
])
def test_the_kernels_sum_a_block_of_columns(dtype, rows, cols, blocks):
  m = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cols)), dtype)
  norms = jax.jit(lambda m: direct_clip_call([m] * len(blocks), columns=np.ravel(blocks))[0])(m)
  wide = np.asarray(m.astype(jnp.float32), np.float64)
  want = [np.sqrt(np.sum(np.square(wide[:, f:f + w]))) for f, w in blocks]
  np.testing.assert_allclose(norms, [np.sqrt(np.sum(np.square(want)))] + want, rtol=2e-7)


@pytest.mark.parametrize("operands, columns, scale, message", [
    ([jnp.ones((4, 6))], [0, 2, 2, 2], False, "columns has 4 values for 1 leaves"),
    ([jnp.ones((4, 6))], [5, 2], False, "columns of leaf 0 (first 5, width 2) are not within "
                                        "its operand's 6 columns"),
    ([jnp.ones((4, 6))], [-1, 2], False, "(first -1, width 2) are not within"),
    ([jnp.ones((4, 6))], [1, 0], False, "(first 1, width 0) are not within"),
    ([jnp.ones(6)], [0, 2], False, "columns of leaf 0 need a two-dimensional operand; it has 1"),
    ([jnp.ones((4, 6))], [0, 2], True, "columns of leaf 0 are given, but the call scales"),
])
def test_the_handler_names_bad_columns(operands, columns, scale, message):
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU handler's check; the CUDA handler decodes the same way")
  with pytest.raises(Exception, match=re.escape(message)):
    jax.block_until_ready(direct_clip_call(operands, columns=columns, scale=scale))
