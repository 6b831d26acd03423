"""The step's speed options keep its numbers (model.py: remat, attention, dtype), the
settings they resolve to per platform (config.py), the MFU formula (throughput.py), and
what the clip's custom call reads of the model's gradients."""

import collections
import dataclasses
import re

import clipjax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpt import config, flags, model as model_lib
from gpt.reports import throughput
from gpt.training import loop


SMALL = model_lib.ModelConfig(num_layers=2, d_model=64, num_heads=4, vocab_size=300,
                              context_length=16)


def _cross_entropy(logits, targets):
  """Each target's loss under `logits` (the model's `__call__`), as written out here."""
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def _loss_and_grads(model_cfg):
  """The next-token loss of a small GPT on a fixed batch, and its gradients."""
  graphdef, params = nnx.split(model_lib.GPT(model_cfg, nnx.Rngs(0)))
  tokens = np.random.default_rng(0).integers(0, 300, (4, 17), dtype=np.int32)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return _cross_entropy(logits, tokens[:, 1:]).mean()

  return jax.jit(jax.value_and_grad(loss_fn))(params)


@pytest.fixture(scope="module")
def plain():
  return _loss_and_grads(SMALL)


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_recomputes_the_same_numbers(plain, remat):
  loss, grads = _loss_and_grads(dataclasses.replace(SMALL, remat=remat))
  np.testing.assert_allclose(loss, plain[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
               grads, plain[1])


def test_bfloat16_compute_follows_float32(plain):
  """bfloat16 matmuls (float32 parameters, LayerNorm statistics and loss) give the
  float32 loss and gradients to bfloat16's precision."""
  loss, grads = _loss_and_grads(dataclasses.replace(SMALL, dtype="bfloat16"))
  assert loss != plain[0]
  np.testing.assert_allclose(loss, plain[0], rtol=1e-2)
  norm = lambda tree: np.sqrt(sum(float(jnp.sum(x.astype(jnp.float32)**2))
                                  for x in jax.tree.leaves(tree)))
  assert norm(grads) == pytest.approx(norm(plain[1]), rel=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_losses_are_the_cross_entropy_of_the_logits(dtype):
  """Training's losses (the LM head padded to VOCAB_ALIGN columns, the padding masked)
  are those of the model's logits: 300 columns are padded to 384. (With a vocabulary
  that needs no padding, test_example_loop.py pins the losses.) In bfloat16 the padded
  matmul may round its logits differently (a bfloat16 ulp is 2**-8); in float32 the
  matmuls run in float32, where a GPU's default would round their inputs to
  TensorFloat-32, differently for the padded shape."""
  vocab_size = 300
  model_cfg = dataclasses.replace(SMALL, num_layers=1, dtype=dtype)
  graphdef, params = nnx.split(model_lib.GPT(model_cfg, nnx.Rngs(0)))
  tokens = np.random.default_rng(1).integers(0, vocab_size, (4, 17), dtype=np.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def from_logits(params):
    return _cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

  def padded(params):
    return nnx.merge(graphdef, params).token_losses(inputs, targets)

  # Each: (the mean loss, the per-token losses) and the mean's gradients, in one jit.
  run = lambda f: jax.jit(jax.value_and_grad(lambda p: (f(p).mean(), f(p)), has_aux=True))(
      params)
  with jax.default_matmul_precision("float32" if dtype == "float32" else None):
    ((_, want), want_grads), ((_, got), got_grads) = run(from_logits), run(padded)
  assert got.shape == (4, 16) and got.dtype == jnp.float32
  tol = {"float32": 1e-6, "bfloat16": 2**-8}[dtype]
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  assert got_grads["lm_head"]["kernel"].shape == (64, vocab_size)
  # The largest entry of any gradient sets the tolerance: some are zero up to rounding
  # (the key bias's, as the softmax ignores it).
  scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want_grads))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                          jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=0, atol=10 * tol * scale, err_msg=str(path))


@pytest.mark.parametrize("logsumexp", ["_logsumexp_one_pass", "_logsumexp_two_pass"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab_size", [300, 384])
def test_padded_cross_entropy_is_the_cross_entropy_of_the_vocabulary(
    monkeypatch, logsumexp, dtype, vocab_size):
  """Losses and logit gradients of `padded_cross_entropy` against the written-out
  cross-entropy of the first `vocab_size` columns, on logits up to +-3e4 (exp of such
  logits overflows unless the sum is taken relative to the max), with the log-sum-exp of
  a GPU (one pass) and of other devices (two). Padding columns get zero gradient. A NaN
  logit gives a NaN loss, which the step's spike handling sees."""
  monkeypatch.setattr(model_lib, "_logsumexp", getattr(model_lib, logsumexp))
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((3, 5, 384)) * np.array([1.0, 30.0, 3e4])[:, None, None]
  logits = jnp.asarray(logits, dtype)
  targets = rng.integers(0, vocab_size, (3, 5), dtype=np.int32)
  g = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
  got, got_vjp = jax.vjp(lambda x: model_lib.padded_cross_entropy(x, targets, vocab_size),
                         logits)
  want, want_vjp = jax.vjp(
      lambda x: _cross_entropy(x[..., :vocab_size].astype(jnp.float32), targets), logits)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  (got_grad,), (want_grad,) = got_vjp(g), want_vjp(g)
  assert got_grad.dtype == logits.dtype
  # Both round a float32 gradient to the logits' dtype, so they may differ by an ulp.
  rtol = {"float32": 1e-5, "bfloat16": 2**-7}[dtype]
  np.testing.assert_allclose(np.asarray(got_grad, np.float32),
                             np.asarray(want_grad, np.float32), rtol=rtol, atol=1e-6)
  assert not np.any(np.asarray(got_grad[..., vocab_size:], np.float32))
  nan_logits = logits.at[1, 2, 7].set(jnp.nan)
  nan_loss = model_lib.padded_cross_entropy(nan_logits, targets, vocab_size)
  assert np.isnan(nan_loss[1, 2]) and np.isfinite(np.delete(nan_loss.ravel(), 7)).all()


def _matmul_dtypes(jaxpr) -> set:
  """The operand dtypes of every dot_general in `jaxpr`, nested calls included."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.update(str(v.aval.dtype) for v in eqn.invars)
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        found |= _matmul_dtypes(inner)
  return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_computes_in_its_dtype_and_keeps_float32_parameters(dtype):
  cfg = model_lib.ModelConfig(num_layers=1, d_model=32, num_heads=2, vocab_size=300,
                              context_length=8, dtype=dtype)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.GPT(cfg, nnx.Rngs(0))))
  forward = lambda state, tokens: nnx.merge(graphdef, state)(tokens)
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  assert _matmul_dtypes(jax.make_jaxpr(forward)(state, tokens).jaxpr) == {dtype}
  assert jax.eval_shape(forward, state, tokens).dtype == jnp.float32  # the logits
  assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}


def test_the_embeddings_gradients_are_summed_in_float32():
  """In bfloat16 a token that fills the batch gets, as its embedding's gradient, the
  float32 sum of its 512 positions' gradients (a bfloat16 sum was off by up to 1.3 in sums
  of about 20), and each position the float32 sum over the batch."""
  cfg = model_lib.ModelConfig(num_layers=1, d_model=32, num_heads=2, vocab_size=300,
                              context_length=64, dtype="bfloat16")
  graphdef, params = nnx.split(model_lib.GPT(cfg, nnx.Rngs(0)), nnx.Param)
  tokens_BxL = jnp.full((8, 64), 7, jnp.int32)
  g_BxLxD = jax.random.normal(jax.random.key(1), (8, 64, 32), jnp.bfloat16)

  def loss(params):
    x_BxLxD = nnx.merge(graphdef, params).embed(tokens_BxL)
    assert x_BxLxD.dtype == jnp.bfloat16
    return jnp.sum(x_BxLxD.astype(jnp.float32) * g_BxLxD.astype(jnp.float32))

  grads = jax.jit(jax.grad(loss))(params)
  g = np.asarray(g_BxLxD, np.float64)
  token_grad = np.asarray(grads["token_embed"]["embedding"][...])
  np.testing.assert_allclose(token_grad[7], g.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
  assert not np.any(np.delete(token_grad, 7, axis=0))
  np.testing.assert_allclose(np.asarray(grads["pos_embed"]["embedding"][...]), g.sum(axis=0),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not clipjax.ffi_platforms(), reason="no clipjax custom-call handler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_clip_reads_each_blocks_q_k_v_gradients_from_one_merged_matmul(dtype):
  """The attention's q, k and v are dense layers of one input, so their weight gradients
  are matmuls that XLA's GPU compiler merges; the clip's custom call reads each block's
  three as columns of one array (clipjax's column reads), rather than a copy of each."""
  cfg = model_lib.ModelConfig(**{**vars(SMALL), "dtype": dtype})
  graphdef, params = nnx.split(model_lib.GPT(cfg, nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((2, 17), jnp.int32)
  tx = optax.chain(clipjax.andrea_clip(1.0, impl="ffi"), optax.adamw(1e-3))

  def step(params, opt_state):
    grads = jax.grad(lambda p: nnx.merge(graphdef, p).token_losses(
        tokens[:, :-1], tokens[:, 1:]).mean())(params)
    return tx.update(grads, opt_state, params)

  text = jax.jit(step).lower(params, tx.init(params)).as_text()
  [call] = [line for line in text.splitlines() if "@clipjax_andrea_clip(" in line]
  flat = [int(v) for v in re.search(r"columns = (?:dense<\[?|array<i64: )([-0-9, ]*)", call)
          .group(1).split(",")]
  widths = flat[1::2]
  assert sorted(w for w in widths if w) == [SMALL.d_model] * (3 * SMALL.num_layers)


# --- Settings per platform ---------------------------------------------------------


@pytest.mark.parametrize("platform, dtype, attention, want", [
    ("cpu", "auto", "auto", ("float32", "xla")),
    ("gpu", "auto", "auto", ("bfloat16", "cudnn")),
    ("tpu", "auto", "auto", ("bfloat16", "xla")),
    ("gpu", "float32", "auto", ("float32", "xla")),  # cuDNN's flash attention is bf16
    ("gpu", "bfloat16", "xla", ("bfloat16", "xla")),
    ("cpu", "bfloat16", "auto", ("bfloat16", "xla")),
])
def test_auto_settings_resolve_per_platform(platform, dtype, attention, want):
  cfg = config.resolve(config.TrainConfig(dtype=dtype, attention=attention), platform)
  assert (cfg.dtype, cfg.attention) == want


@pytest.mark.parametrize("platform, dtype", [("cpu", "bfloat16"), ("gpu", "float32")])
def test_cudnn_attention_where_it_cannot_run_is_refused(platform, dtype):
  with pytest.raises(config.ConfigError, match="--attention cudnn runs on NVIDIA GPUs in "
                     "bfloat16"):
    config.resolve(config.TrainConfig(dtype=dtype, attention="cudnn"), platform)


@pytest.mark.parametrize("argv, message", [
    (["--log-every", "0"], "--log-every must be > 0, got 0"),
    (["--peak-tflops", "-1"], "--peak-tflops must be > 0, got -1"),
    (["--remat", "all"], "argument --remat: invalid choice: 'all'"),
])
def test_bad_speed_flags_are_named(argv, message):
  with pytest.raises((config.ConfigError, SystemExit)) as e:
    config.resolve(flags.parse_args(argv)[1])
  if e.type is config.ConfigError:
    assert message in str(e.value)


# --- MFU ---------------------------------------------------------------------------

Device = collections.namedtuple("Device", "device_kind")


def test_flops_per_token_of_andrea_120m():
  """6 N + 12 * layers * d_model * context, N without the embedding tables: 662.5M at
  context 1024, so 174,939 tokens/s (andrea-120m on one H200 before the loop was made
  fast, docs/experiments.md section 4) is 116 TFLOP/s, 11.7% of the bf16 peak."""
  cfg = config.resolve(config.TrainConfig(config="andrea-120m"))
  model_cfg = loop.model_config(cfg)
  shapes = jax.eval_shape(lambda: loop.init_model(cfg)[1])
  n_all = sum(x.size for x in jax.tree.leaves(shapes))
  n = n_all - (8449 + 1024) * 768  # token and position tables
  flops = throughput.flops_per_token(shapes, num_layers=12, d_model=768,
                                     context_length=1024)
  assert flops == 6 * n + 12 * 12 * 768 * 1024
  assert (model_cfg.num_layers, model_cfg.d_model) == (12, 768)
  assert round(flops / 1e5) == 6625
  peak = throughput.peak_flops([Device("NVIDIA H200")])
  assert peak == 989e12
  assert throughput.mfu(174_939, flops, peak) == pytest.approx(0.117, abs=5e-4)


def test_the_peak_is_known_or_given():
  assert throughput.peak_flops([Device("NVIDIA H100 80GB HBM3")] * 2) == 2 * 989e12
  assert throughput.peak_flops([Device("cpu")]) is None
  assert throughput.peak_flops([Device("NVIDIA H200"), Device("cpu")]) is None
  assert throughput.peak_flops([Device("cpu")] * 4, peak_tflops=2.0) == 8e12
  assert throughput.mfu(1000.0, 1e6, None) is None
