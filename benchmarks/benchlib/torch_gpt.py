"""torch's side of examples/benchmark.py: the example's GPT (examples/gpt/model.py) written
in torch, leaf for leaf, and its training step as a torch user writes it, eagerly: forward
(bfloat16 autocast over float32 parameters, or bfloat16 parameters), the float32 logits'
cross-entropy, backward, then fused AdamW alone or after clip_grad_norm_(foreach=True).

The same architecture: learned positional embeddings, pre-LayerNorm blocks (epsilon 1e-6,
as flax's) with separate query, key and value projections, a 4x tanh-GELU MLP, an untied
LM head without bias. Attention is torch's "math" scaled_dot_product_attention, which
forms the scores in memory as XLA's attention does in the JAX step (the benchmark's model
runs `attention="xla"`)."""

from __future__ import annotations

import math

from benchlib.timing import timed_steps


def build_gpt(torch, cfg, device):
  """A torch GPT of the example's ModelConfig `cfg`, float32 parameters, on `device`."""
  nn, F = torch.nn, torch.nn.functional
  d, h = cfg.d_model, cfg.num_heads
  out_std = 0.02 / math.sqrt(2 * cfg.num_layers)

  def linear(d_in, d_out, std=0.02, bias=True):
    layer = nn.Linear(d_in, d_out, bias=bias)
    nn.init.normal_(layer.weight, std=std)
    if bias:
      nn.init.zeros_(layer.bias)
    return layer

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln_attn, self.ln_mlp = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
      self.query, self.key, self.value = linear(d, d), linear(d, d), linear(d, d)
      self.out = linear(d, d, out_std)
      self.up = linear(d, cfg.mlp_ratio * d)
      self.down = linear(cfg.mlp_ratio * d, d, out_std)

    def forward(self, x):
      B, L, _ = x.shape
      y = self.ln_attn(x)
      q, k, v = (p(y).view(B, L, h, d // h).transpose(1, 2)
                 for p in (self.query, self.key, self.value))
      with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.out(y.transpose(1, 2).reshape(B, L, d))
      return x + self.down(F.gelu(self.up(self.ln_mlp(x)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.token_embed = nn.Embedding(cfg.vocab_size, d)
      self.pos_embed = nn.Embedding(cfg.context_length, d)
      nn.init.normal_(self.token_embed.weight, std=0.02)
      nn.init.normal_(self.pos_embed.weight, std=0.02)
      self.blocks = nn.ModuleList(Block() for _ in range(cfg.num_layers))
      self.ln_final = nn.LayerNorm(d, eps=1e-6)
      self.lm_head = linear(d, cfg.vocab_size, bias=False)

    def forward(self, tokens_BxL):
      x = self.token_embed(tokens_BxL) + self.pos_embed.weight[:tokens_BxL.shape[1]]
      for block in self.blocks:
        x = block(x)
      return self.lm_head(self.ln_final(x))

  return GPT().to(device)


def make_step(torch, model, *, clip_norm, learning_rate, weight_decay, autocast):
  """step(tokens_BxL1) -> None: one training step of `model`, in place. clip_norm: None
  for fused AdamW alone, else clip_grad_norm_(foreach=True) to it first."""
  F = torch.nn.functional
  params = list(model.parameters())
  device = params[0].device
  opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay,
                          fused=device.type == "cuda")

  def step(tokens_BxL1):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
      logits_BxLxV = model(tokens_BxL1[:, :-1])
    loss = F.cross_entropy(logits_BxLxV.float().flatten(0, 1), tokens_BxL1[:, 1:].flatten())
    loss.backward()
    if clip_norm is not None:
      torch.nn.utils.clip_grad_norm_(params, clip_norm, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)

  return step


class TorchRunner:
  """examples/benchmark.py's Runner for torch: one variant's model, optimizer and batch, carried
  from round to round, read on the same clocks (its profiled round is JAX's profiler's,
  whose CUPTI tracing records the process's kernels, torch's among them)."""

  def __init__(self, torch, variant, cfg, param_dtype, tokens, *, clip_norm, learning_rate,
               weight_decay):
    self.torch, self.variant = torch, variant
    self.model = build_gpt(torch, cfg, "cuda")
    if param_dtype == "bf16":
      self.model.to(torch.bfloat16)
    self.tokens = torch.as_tensor(tokens, dtype=torch.long, device="cuda")
    self.step = make_step(torch, self.model, clip_norm=clip_norm,
                          learning_rate=learning_rate, weight_decay=weight_decay,
                          autocast=param_dtype == "f32")
    # No XLA program: its kernels are classed by their own names (profiling.kernel_classes).
    self.compile_s, self.hlo, self.shapes = None, {"fusions": None}, {}
    self.run(2)  # warm-up: cuBLAS's and the allocator's first calls

  def run(self, steps, drained=False):
    """(wall seconds, [seconds inside each call]) of `steps` steps (`timing.timed_steps`)."""
    return timed_steps(self.torch.cuda.synchronize, lambda: self.step(self.tokens), steps,
                       drained)

  def clip_facts(self):
    return {}
