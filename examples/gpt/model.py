"""A decoder-only GPT in Flax NNX, with the configurations named after the ANDREA models.

Pre-LayerNorm blocks; separate query, key and value projections (as in the ANDREA
models); a 4x GELU MLP; learned positional embeddings; an untied LM head. Shapes are
in the names: B batch, L sequence length, D d_model, H heads, K head size, V vocab.

Parameters are float32; `dtype` is the computation's (bfloat16: each matmul takes and
gives bfloat16; the embeddings are looked up and summed in float32, then cast, so their
gradients are summed in float32; LayerNorm's statistics are float32, and the logits are
cast to float32 for the loss). Attention is `jax.nn.dot_product_attention` with an explicit
implementation: "xla" (any device) or "cudnn" (cuDNN's fused flash attention: NVIDIA
GPUs, bfloat16 or float16). `remat` recomputes each block's activations in the backward
pass instead of keeping them: "block" all of them, "dots" all but the matmuls' outputs.

Training takes its losses from `GPT.token_losses`, whose LM head runs on the vocabulary
padded to a multiple of VOCAB_ALIGN (zero columns, masked out of the softmax), and whose
cross-entropy (`padded_cross_entropy`) keeps the logits in the computation dtype (on a
GPU it reads them once each way): the same losses as the cross-entropy of
`GPT.__call__`'s logits, and on a GPU a faster step.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ANDREA_VOCAB_SIZE, REMAT_CHOICES


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  num_layers: int
  d_model: int
  num_heads: int
  vocab_size: int = ANDREA_VOCAB_SIZE
  context_length: int = 1024
  mlp_ratio: int = 4
  dtype: str = "float32"  # computation dtype; parameters stay float32
  attention: str = "xla"  # jax.nn.dot_product_attention's implementation: xla, cudnn
  remat: str = "none"  # none, block, dots (REMAT_POLICIES)

  @property
  def head_size(self) -> int:
    return self.d_model // self.num_heads


# What each block keeps for the backward pass (jax.checkpoint policies): None keeps
# nothing (everything is recomputed); "dots" keeps the matmuls' outputs.
REMAT_POLICIES = {"block": None,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
assert REMAT_CHOICES == ("none", *REMAT_POLICIES)  # the flag's choices (config.py)

# The LM head's matmul in training runs on the vocabulary rounded up to a multiple of this.
# cuBLAS's tiles want aligned sizes: andrea-120m's 8,449 columns padded to 8,576 make its
# bfloat16 step faster on a GPU (measured with experiments/bench_speed.py, docs/performance.md).
VOCAB_ALIGN = 128

# Architectures only; context length, vocab, dtype, attention and remat are set by the
# training flags.
MODEL_CONFIGS = {
    "tiny": ModelConfig(num_layers=4, d_model=128, num_heads=4),
    "andrea-12m": ModelConfig(num_layers=6, d_model=384, num_heads=6),
    "andrea-120m": ModelConfig(num_layers=12, d_model=768, num_heads=12),
}


def _linear(d_in, d_out, cfg, rngs, *, stddev=0.02, use_bias=True):
  return nnx.Linear(
      d_in, d_out, use_bias=use_bias, dtype=jnp.dtype(cfg.dtype),
      kernel_init=nnx.initializers.normal(stddev), rngs=rngs)


class CausalSelfAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.d_model
    # Residual-branch outputs start smaller so the residual stream's variance does not
    # grow with depth (GPT-2 initialisation).
    out_stddev = 0.02 / math.sqrt(2 * cfg.num_layers)
    self.query = _linear(d, d, cfg, rngs)
    self.key = _linear(d, d, cfg, rngs)
    self.value = _linear(d, d, cfg, rngs)
    self.out = _linear(d, d, cfg, rngs, stddev=out_stddev)
    self.num_heads = cfg.num_heads
    self.implementation = cfg.attention

  def __call__(self, x_BxLxD):
    B, L, D = x_BxLxD.shape
    H = self.num_heads
    q_BxLxHxK = self.query(x_BxLxD).reshape(B, L, H, D // H)
    k_BxLxHxK = self.key(x_BxLxD).reshape(B, L, H, D // H)
    v_BxLxHxK = self.value(x_BxLxD).reshape(B, L, H, D // H)
    y_BxLxHxK = jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True,
        implementation=self.implementation)
    return self.out(y_BxLxHxK.reshape(B, L, D))


class Mlp(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, d_hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    self.up = _linear(d, d_hidden, cfg, rngs)
    self.down = _linear(
        d_hidden, d, cfg, rngs, stddev=0.02 / math.sqrt(2 * cfg.num_layers))

  def __call__(self, x_BxLxD):
    return self.down(jax.nn.gelu(self.up(x_BxLxD)))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.ln_attn = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.attn = CausalSelfAttention(cfg, rngs)
    self.ln_mlp = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mlp = Mlp(cfg, rngs)

  def __call__(self, x_BxLxD):
    x_BxLxD = x_BxLxD + self.attn(self.ln_attn(x_BxLxD))
    return x_BxLxD + self.mlp(self.ln_mlp(x_BxLxD))


class GPT(nnx.Module):
  """tokens_BxL (int) -> logits_BxLxV (float32)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    embed_init = nnx.initializers.normal(0.02)
    # The lookups are float32, cast to the computation dtype after the sum (`embed`), so
    # that the tables' gradients are summed in float32. Cast before the lookup, the token
    # table's gradient is a scatter-add of bfloat16 rows, which on real text, whose tokens
    # repeat, is slow on a GPU and inexact; summed in float32 the step is faster
    # (measured with experiments/bench_speed.py, docs/performance.md).
    self.token_embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init,
                                 rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.context_length, cfg.d_model, embedding_init=embed_init,
                               rngs=rngs)
    self.compute_dtype = jnp.dtype(cfg.dtype)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.remat = cfg.remat
    self.ln_final = nnx.LayerNorm(cfg.d_model, dtype=self.compute_dtype, rngs=rngs)
    self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs, use_bias=False)

  def embed(self, tokens_BxL):
    """tokens_BxL -> x_BxLxD, the token and position embeddings' sum, in the computation
    dtype."""
    L = tokens_BxL.shape[1]
    return (self.token_embed(tokens_BxL)
            + self.pos_embed(jnp.arange(L))[None]).astype(self.compute_dtype)

  def hidden(self, tokens_BxL):
    """tokens_BxL -> the final LayerNorm's output, x_BxLxD, in the computation dtype."""
    x_BxLxD = self.embed(tokens_BxL)
    apply_block = lambda block, x_BxLxD: block(x_BxLxD)
    if self.remat != "none":
      apply_block = nnx.remat(apply_block, policy=REMAT_POLICIES[self.remat])
    for block in self.blocks:
      x_BxLxD = apply_block(block, x_BxLxD)
    return self.ln_final(x_BxLxD)

  def __call__(self, tokens_BxL):
    return self.lm_head(self.hidden(tokens_BxL)).astype(jnp.float32)

  def token_losses(self, tokens_BxL, targets_BxL):
    """The cross-entropy of each target token given the tokens up to it: loss_BxL
    (float32). The LM head multiplies by its kernel padded with zero columns to a multiple
    of VOCAB_ALIGN, and the padded logits are set to -inf, so the softmax is over the
    vocabulary alone; the logits are never sliced out of the padded array (a copy)."""
    x_BxLxD = self.hidden(tokens_BxL)
    kernel_DxV = self.lm_head.kernel[...].astype(x_BxLxD.dtype)
    V = kernel_DxV.shape[1]
    logits_BxLxP = jnp.einsum("bld,dp->blp", x_BxLxD,
                              jnp.pad(kernel_DxV, ((0, 0), (0, -V % VOCAB_ALIGN))))
    return padded_cross_entropy(logits_BxLxP, targets_BxL, V)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def padded_cross_entropy(logits_BxLxP, targets_BxL, vocab_size):
  """The cross-entropy of each target given logits whose columns from `vocab_size` on are
  padding: loss_BxL (float32), the padding outside the softmax. The logits stay in their
  dtype: on a GPU the forward pass reads them once (a one-pass log-sum-exp), and the
  backward pass reads them once more and writes their gradient in the same dtype.
  (Under autodiff, optax's cross-entropy builds the gradient as a float32 array,
  scatters the targets' -1 into it, then converts it: three passes over twice the
  bytes.)"""
  return _cross_entropy_forward(logits_BxLxP, targets_BxL, vocab_size)[0]


def _masked_float32(logits_BxLxP, vocab_size):
  logits_BxLxP = logits_BxLxP.astype(jnp.float32)
  if logits_BxLxP.shape[-1] == vocab_size:
    return logits_BxLxP
  return jnp.where(jnp.arange(logits_BxLxP.shape[-1]) < vocab_size, logits_BxLxP, -jnp.inf)


def _logsumexp(x_BxLxP):
  """log(sum(exp(x))) over the last axis: in one pass over x on an NVIDIA GPU, in two
  elsewhere (XLA's CPU backend runs the one-pass reduction's pairs element by element:
  the CPU step was 20% slower with it)."""
  return jax.lax.platform_dependent(x_BxLxP, cuda=_logsumexp_one_pass,
                                    default=_logsumexp_two_pass)


def _logsumexp_two_pass(x_BxLxP):
  top = jnp.max(x_BxLxP, axis=-1)
  return top + jnp.log(jnp.sum(jnp.exp(x_BxLxP - top[..., None]), axis=-1))


def _logsumexp_one_pass(x_BxLxP):
  """One reduction: each partial result is a (max, sum of exp(x - max)) pair, and two
  pairs combine by rescaling to the larger max."""

  def combine(a, b):
    (max_a, sum_a), (max_b, sum_b) = a, b
    top = jnp.maximum(max_a, max_b)
    # A -inf max (only padding so far) adds nothing; -inf - -inf would be NaN.
    part = lambda m, s: jnp.where(m == -jnp.inf, 0.0, s * jnp.exp(m - top))
    return top, part(max_a, sum_a) + part(max_b, sum_b)

  top, total = jax.lax.reduce((x_BxLxP, jnp.ones_like(x_BxLxP)),
                              (jnp.float32(-jnp.inf), jnp.float32(0)), combine,
                              (x_BxLxP.ndim - 1,))
  return top + jnp.log(total)


def _cross_entropy_forward(logits_BxLxP, targets_BxL, vocab_size):
  x_BxLxP = _masked_float32(logits_BxLxP, vocab_size)
  lse_BxL = _logsumexp(x_BxLxP)
  target_BxL = jnp.take_along_axis(x_BxLxP, targets_BxL[..., None], axis=-1)[..., 0]
  return lse_BxL - target_BxL, (logits_BxLxP, targets_BxL, lse_BxL)


def _cross_entropy_backward(vocab_size, saved, g_BxL):
  logits_BxLxP, targets_BxL, lse_BxL = saved
  x_BxLxP = _masked_float32(logits_BxLxP, vocab_size)
  is_target = jnp.arange(x_BxLxP.shape[-1]) == targets_BxL[..., None]
  grad_BxLxP = (jnp.exp(x_BxLxP - lse_BxL[..., None]) - is_target) * g_BxL[..., None]
  return grad_BxLxP.astype(logits_BxLxP.dtype), None


padded_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
