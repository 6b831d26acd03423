"""Tokens per second and model FLOPs utilization (MFU): how close a run comes to the devices'
peak.

The model's FLOPs per token (forward and backward) are counted as in the PaLM paper's
appendix B:

    6 N + 12 * layers * d_model * context_length

N is the parameter count without the token and position embedding tables (a table lookup
does no multiply-adds; the untied LM head is a matmul and counts). The 6 N term is the
matmuls' two FLOPs a multiply-add, forward once and backward twice; the second term is
the attention's scores and their weighted sum over the whole context, also forward and
backward. For andrea-120m at context 1024 that is 6 * 91.54M + 113.2M = 662.5M FLOPs a
token. Work the step does beyond this (recomputation under --remat, the causal half of
the attention that XLA computes and masks, the optimizer) does not count.

    MFU = tokens/s * FLOPs per token / (devices * one device's dense peak)

The peak is the dense (not 2:4 sparse) bfloat16 tensor-core rate from the device's data
sheet, whatever the run's dtype, so a float32 run's MFU says how far it is from what the
device can do in bfloat16. Devices not in PEAK_TFLOPS have no MFU unless --peak-tflops
gives their peak.
"""

import jax

# Dense bfloat16 TFLOP/s per device, by jax.Device.device_kind (NVIDIA's data sheets for
# the SXM parts: 989.4 for both; H200 NVL and H100 PCIe are lower and not listed).
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H200": 989.0,
}
EMBEDDING_TABLES = ("token_embed", "pos_embed")


def flops_per_token(params, *, num_layers: int, d_model: int, context_length: int) -> float:
  """6 N + 12 * layers * d_model * context_length, N without the embedding tables."""
  embedding = sum(x.size for name in EMBEDDING_TABLES for x in jax.tree.leaves(params[name]))
  n = sum(x.size for x in jax.tree.leaves(params)) - embedding
  return 6.0 * n + 12.0 * num_layers * d_model * context_length


def peak_flops(devices, peak_tflops: float | None = None) -> float | None:
  """The devices' summed dense bf16 peak in FLOP/s: `peak_tflops` per device if given,
  else PEAK_TFLOPS's figure for their kind; None if it is not known."""
  if peak_tflops is None:
    kinds = {d.device_kind for d in devices}
    if len(kinds) != 1 or (peak_tflops := PEAK_TFLOPS.get(kinds.pop())) is None:
      return None
  return peak_tflops * 1e12 * len(devices)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
  return None if peak is None else tokens_per_s * flops_per_token / peak
