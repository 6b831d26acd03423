"""torch's clip_grad_norm_(foreach=True), alone and before fused AdamW, on the same shapes:
the baseline bench_clip.py compares against. Timed with CUDA events; torch needs a CUDA
device here."""

from __future__ import annotations

import statistics

import jax

from benchlib.timing import PER_CALL_FACTOR, max_norm_at
from benchlib.trees import gpt_grad_spec

def import_torch():
  """(torch, "") where torch sees a CUDA device, else (None, why not)."""
  try:
    import torch  # noqa: PLC0415 - optional
  except ImportError as e:
    return None, f"torch is not importable ({e})"
  if not torch.cuda.is_available():
    return None, "torch sees no CUDA device"
  return torch, ""


def cuda_event_seconds(torch, call, calls, repeats, warmup=2):
  """(median seconds per call, samples) between CUDA events around `calls` calls."""
  for c in range(warmup):
    call(c)
  torch.cuda.synchronize()
  samples = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in range(calls):
      call(c)
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / calls)
  return statistics.median(samples), samples


def copy_bandwidth(torch, n_bytes, calls, repeats):
  """Bytes read + written per second by torch's copy_ of one large f32 array."""
  src = torch.randn(n_bytes // 4, device="cuda")
  dst = torch.empty_like(src)
  t, _ = cuda_event_seconds(torch, lambda c: dst.copy_(src), calls, repeats)
  return 2 * (n_bytes // 4) * 4 / t


def params_with_grads(torch, model, dtype_name, seed):
  """The model's parameters (N(0, 0.02)) with .grad set to standard normals."""
  dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
  gen = torch.Generator(device="cuda").manual_seed(seed)
  ps = []
  for x in jax.tree.leaves(gpt_grad_spec(model, dtype_name)):
    p = torch.nn.Parameter(0.02 * torch.randn(x.shape, generator=gen, device="cuda",
                                              dtype=dtype))
    p.grad = torch.randn(x.shape, generator=gen, device="cuda", dtype=dtype)
    ps.append(p)
  return ps


def grad_norm(torch, ps):
  return float(torch.linalg.vector_norm(torch.stack(
      [torch.linalg.vector_norm(p.grad.float()) for p in ps])))


def bench_clip(torch, case, regime, cfg):
  """clip_grad_norm_(foreach=True): per call, and K calls captured in one CUDA graph and
  replayed (the counterpart of K clips in one jitted call). torch multiplies by
  min(1, max_norm / norm) in both regimes, so its work does not depend on the regime."""
  sets = [params_with_grads(torch, case.model, case.dtype, seed=100 + i)
          for i in range(case.rotation)]
  max_norm = max_norm_at(regime, min(grad_norm(torch, ps) for ps in sets), 0)

  def call(c):
    torch.nn.utils.clip_grad_norm_(sets[c % case.rotation], max_norm, foreach=True)

  t, samples = cuda_event_seconds(torch, call, cfg.iters * PER_CALL_FACTOR, cfg.repeats)
  out = {"reps": cfg.reps, "us_call": t * 1e6, "samples_call_us": [s * 1e6 for s in samples]}
  try:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
      for c in range(3):
        call(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      for c in range(cfg.reps):
        call(c)
    t, samples = cuda_event_seconds(torch, lambda c: graph.replay(), cfg.iters, cfg.repeats)
    out["us_graph"] = t / cfg.reps * 1e6
    out["samples_graph_us"] = [s / cfg.reps * 1e6 for s in samples]
  except Exception as e:  # noqa: BLE001 - a failed capture loses only the graph number
    out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
  out["us_injit"] = out["us_device"] = out.get("us_graph")
  return out


def graph_steps(torch, model, dtype, regime, cfg, lr, weight_decay):
  """torch's step on the same shapes, captured in a CUDA graph and replayed: the gradients
  multiplied in place by a loss scale of 1.0 (the pass that materializes them, as the JAX
  steps pay), then fused AdamW (capturable), alone ("adamw") or after
  clip_grad_norm_(foreach=True) ("torch"). Returns {variant: {"us_device": ...}}, the time
  per step between CUDA events around the replays."""
  out = {}
  for variant in ("adamw", "torch"):
    ps = params_with_grads(torch, model, dtype, seed=7)
    max_norm = max_norm_at(regime, grad_norm(torch, ps), 0)
    grads = [p.grad for p in ps]
    loss_scale = torch.ones((), device="cuda")
    opt = torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, fused=True, capturable=True)

    def step(variant=variant, ps=ps, grads=grads, opt=opt, loss_scale=loss_scale,
             max_norm=max_norm):
      torch._foreach_mul_(grads, loss_scale)
      if variant == "torch":
        torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=True)
      opt.step()

    try:
      side = torch.cuda.Stream()
      side.wait_stream(torch.cuda.current_stream())
      with torch.cuda.stream(side):
        for _ in range(3):
          step()
      torch.cuda.current_stream().wait_stream(side)
      graph = torch.cuda.CUDAGraph()
      with torch.cuda.graph(graph):
        step()
      t, samples = cuda_event_seconds(torch, lambda c: graph.replay(),
                                      cfg.iters * PER_CALL_FACTOR, cfg.repeats)
      out[variant] = {"us_device": t * 1e6, "us_injit": t * 1e6,
                      "samples_graph_us": [x * 1e6 for x in samples]}
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the row stays empty
      out[variant] = {"us_device": None, "us_injit": None,
                      "graph_error": f"{type(e).__name__}: {e}"[:300]}
    del ps, grads, opt
    torch.cuda.empty_cache()
  return out
