"""The trace reads (`clipjax._trace_reads`) change what the custom call's norm kernels read,
never a result: CLIPJAX_TRACE_READS=0 turns them off, and where the running JAX's trace does
not expose what they read, clipjax says so once and reads every leaf as stored. It runs on
the default backend: the CPU handler here, the CUDA kernels on a GPU."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _native, _trace_reads

pytestmark = pytest.mark.skipif(not _native.platforms(), reason="no clipjax custom-call handler")


@pytest.fixture(autouse=True)
def _one_device():
  """The reads are a single device's: where there are devices to split over, the
  partitioned call reads the leaves."""
  if jax.device_count() != 1:
    pytest.skip(f"the trace reads are a single device's; this process sees {jax.device_count()}")


def _step_and_operands():
  """A step of a bfloat16-compute model with float32 parameters, chained ahead of adamw: its
  outputs, and the leaf operand types of its clip call."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((8,)), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  tx = optax.chain(clipjax.andrea_clip(0.5, impl="ffi"), optax.adamw(1e-3))

  def loss(p):
    narrow = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    y = x.astype(jnp.bfloat16) @ narrow["w"] + narrow["b"]
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  jax.clear_caches()
  jitted = jax.jit(step)
  text = jitted.lower(params, tx.init(params)).as_text()
  calls = [line for line in text.splitlines() if "@clipjax_andrea_clip(" in line]
  operands = [t for c in calls for t in c.rsplit(" : (", 1)[1].split(") ->")[0].split(", ")[1:]]
  return jax.device_get(jitted(params, tx.init(params))), operands


def _same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_the_switch_turns_the_reads_off_with_the_same_bits(monkeypatch):
  monkeypatch.delenv(_trace_reads.SWITCH, raising=False)
  on, operands_on = _step_and_operands()
  monkeypatch.setenv(_trace_reads.SWITCH, "0")
  off, operands_off = _step_and_operands()
  assert any("bf16" in t for t in operands_on)  # on: the norms read the bfloat16 sources
  assert operands_off and not any("bf16" in t for t in operands_off)  # off: the leaves
  _same_bits(on, off)


def test_a_trace_that_hides_what_the_reads_take_warns_once_with_the_same_bits(monkeypatch):
  monkeypatch.delenv(_trace_reads.SWITCH, raising=False)
  want, _ = _step_and_operands()
  monkeypatch.setattr(_trace_reads, "_trace_is_readable", lambda: False)
  monkeypatch.setattr(_trace_reads, "_warned", False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got, operands = _step_and_operands()
    _step_and_operands()
  said = [str(w.message) for w in caught if "clipjax" in str(w.message)]
  assert len(said) == 1 and f"jax {jax.__version__}" in said[0]
  assert operands and not any("bf16" in t for t in operands)
  _same_bits(want, got)


def test_the_switch_off_says_nothing_where_the_trace_hides_them(monkeypatch):
  monkeypatch.setenv(_trace_reads.SWITCH, "0")
  monkeypatch.setattr(_trace_reads, "_trace_is_readable", lambda: False)
  monkeypatch.setattr(_trace_reads, "_warned", False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _step_and_operands()


def test_the_probe_finds_what_the_reads_take_in_this_jax():
  assert _trace_reads._trace_is_readable()


def test_the_probe_fails_where_the_trace_hides_an_equation(monkeypatch):
  monkeypatch.setattr(_trace_reads, "_producer", lambda x, primitive: None)
  _trace_reads._trace_is_readable.cache_clear()
  try:
    assert not _trace_reads._trace_is_readable()
  finally:
    _trace_reads._trace_is_readable.cache_clear()
