"""End-of-run report: summary.json, loss and grad-norm curves, samples and their repetition.

The ANDREA documents' failure mode is repetition lock-in (one token comes to dominate
the samples), so every sample is scored by:

  distinct_2       unique bigrams / bigrams (1.0: no bigram repeats)
  repeat_4         fraction of 4-grams that repeat an earlier 4-gram of the same sample
  top_token_share  the most frequent token's share of the sample (lock-in drives it to 1)
"""

import collections
import os
import time

import jax
import jax.numpy as jnp
import matplotlib
from jax.experimental import multihost_utils
import matplotlib.ticker
import numpy as np
from flax import nnx

from ..config import TrainConfig
from ..training import distributed
from . import metrics, throughput

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

REPETITION_SCORES = ("distinct_2", "repeat_4", "top_token_share")
SOURCE_COLORS = {
    "repo-docs": "tab:blue", "gutenberg": "tab:green", "hermes3-general": "tab:orange"}


def write_report(cfg: TrainConfig, records: list[dict], graphdef, params, tokenizer,
                 prompts: list[str], started: float, stopped_at: int | None,
                 flops_per_token: float, peak_flops: float | None) -> dict:
  """Writes report.png, samples.txt and summary.json into the run directory, prints one
  line, and returns the summary. Every process calls it (the samples are computed on
  the mesh, the memory peaks gathered); process 0 writes and prints."""
  steps = metrics.step_records(records)
  tokens_per_s = float(np.median([r["tokens_per_s"] for r in steps]))
  local_peak = max((b for r in steps for b in r.get("device_memory_bytes") or []), default=0)
  peaks = multihost_utils.process_allgather(np.int64(local_peak)).reshape(-1).tolist()
  summary = {
      "config": cfg.config, "recipe": cfg.recipe, "steps": len(steps),
      "planned_steps": cfg.steps, "stopped_by_time_limit": stopped_at is not None,
      "initial_loss": steps[0]["loss"],
      "final_loss": float(np.mean([r["loss"] for r in steps[-10:]])),
      "clipped_steps": sum(r["clipped"] for r in steps),
      "spike_steps": [r["step"] for r in steps if r.get("spike")],
      "skipped_steps": steps[-1].get("skipped_count", 0),
      "median_tokens_per_s": tokens_per_s,
      "median_step_time_s": _median([r.get("step_time_s") for r in steps]),
      # throughput.py: the model's FLOPs a token, the devices' summed peak (None where
      # unknown), and the median tokens/s as a share of that peak.
      "flops_per_token": flops_per_token,
      "peak_flops_per_s": peak_flops,
      "mfu": throughput.mfu(tokens_per_s, flops_per_token, peak_flops),
      # Per process (its own devices), and the largest.
      "peak_device_memory_bytes_by_process": peaks,
      "peak_device_memory_bytes": max(peaks) or None,
      # Step records lost with an earlier run's metrics (see MetricsLog); 0 when whole.
      "missing_step_records": len(metrics.missing_steps(records, steps[-1]["step"])),
  }
  if prompts:
    summary["samples"] = samples(cfg, graphdef, params, tokenizer, prompts)
    summary["repetition"] = mean_stats(summary["samples"])
  if not distributed.is_main():
    return summary
  if cfg.plot:
    png = os.path.join(cfg.out_dir, "report.png")
    plot_run(records, f"{png}.tmp.png", max_norm=cfg.max_norm,
             title=f"{cfg.config}, recipe {cfg.recipe}, seed {cfg.seed}")
    os.replace(f"{png}.tmp.png", png)
  if prompts:
    metrics.write_atomic(os.path.join(cfg.out_dir, "samples.txt"), lambda f: f.writelines(
        f"--- distinct_2 {s['distinct_2']:.2f}  repeat_4 {s['repeat_4']:.2f}  "
        f"top_token_share {s['top_token_share']:.2f}\n{s['prompt']}{s['text']}\n\n"
        for s in summary["samples"]))
  summary["wall_s"] = time.perf_counter() - started
  metrics.write_json_atomic(os.path.join(cfg.out_dir, "summary.json"), summary)
  repetition = ", ".join(f"{k} {v:.2f}" for k, v in summary.get("repetition", {}).items())
  print(f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the "
        f"last 10 steps); {summary['clipped_steps']} of {len(steps)} steps clipped, "
        f"{len(summary['spike_steps'])} spikes, {summary['skipped_steps']} skipped; "
        f"{tokens_per_s:,.0f} tokens/s (median){_mfu_words(summary)}; "
        f"samples: {repetition or 'none'}; files in {cfg.out_dir}")
  return summary


def _mfu_words(summary: dict) -> str:
  if summary["mfu"] is None:
    return ", MFU unknown (no peak for these devices: --peak-tflops)"
  return (f", MFU {summary['mfu']:.1%} ({summary['flops_per_token'] / 1e6:,.0f}M FLOPs a "
          f"token, peak {summary['peak_flops_per_s'] / 1e12:,.0f} TFLOP/s)")


def _median(values) -> float | None:
  values = [v for v in values if v is not None]
  return float(np.median(values)) if values else None


# --- Samples ----------------------------------------------------------------------


def samples(cfg: TrainConfig, graphdef, params, tokenizer, prompts: list[str]) -> list[dict]:
  """One continuation of each prompt, with its repetition scores. A prompt keeps at most
  half the context (its first tokens), so that there is room to continue it."""
  prompt_ids = [tokenizer.encode(p).ids[:cfg.context_length // 2] for p in prompts]
  outputs = generate(graphdef, params, prompt_ids, num_tokens=cfg.sample_tokens,
                     context_length=cfg.context_length, temperature=cfg.sample_temperature,
                     seed=cfg.seed)
  return [{"prompt": tokenizer.decode(ids),
           "text": tokenizer.decode(out, skip_special_tokens=False), **repetition_stats(out)}
          for ids, out in zip(prompt_ids, outputs)]


def generate(graphdef, params, prompts: list[list[int]], *, num_tokens: int,
             context_length: int, temperature: float, seed: int) -> list[list[int]]:
  """Continues each prompt by num_tokens tokens (fewer if the context is full)."""
  B = len(prompts)
  prompt_len_B = np.array([len(p) for p in prompts], np.int32)
  num_tokens = min(num_tokens, context_length - int(prompt_len_B.max()))
  tokens_BxL = np.zeros((B, context_length), np.int32)
  for b, prompt in enumerate(prompts):
    tokens_BxL[b, :len(prompt)] = prompt

  @jax.jit
  def continue_all(params, tokens_BxL, prompt_len_B, key):
    rows_B = jnp.arange(B)

    def add_token(i, carry):
      tokens_BxL, key = carry
      # Causal attention: the unfilled positions after i do not change earlier logits.
      logits_BxLxV = nnx.merge(graphdef, params)(tokens_BxL)
      logits_BxV = logits_BxLxV[rows_B, prompt_len_B + i - 1]
      key, subkey = jax.random.split(key)
      if temperature > 0:
        next_B = jax.random.categorical(subkey, logits_BxV / temperature)
      else:
        next_B = jnp.argmax(logits_BxV, axis=-1)
      return tokens_BxL.at[rows_B, prompt_len_B + i].set(next_B), key

    return jax.lax.fori_loop(0, num_tokens, add_token, (tokens_BxL, key))[0]

  # The tokens may be split over several processes' devices: each process gets them all.
  out_BxL = multihost_utils.process_allgather(
      continue_all(params, tokens_BxL, prompt_len_B, jax.random.key(seed)), tiled=True)
  return [out_BxL[b, n:n + num_tokens].tolist() for b, n in enumerate(prompt_len_B)]


def repetition_stats(tokens: list[int]) -> dict[str, float]:
  def ngrams(n):
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]

  bigrams, fourgrams = ngrams(2), ngrams(4)  # the keys are REPETITION_SCORES
  return {
      "distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 1.0,
      "repeat_4": 1 - len(set(fourgrams)) / len(fourgrams) if fourgrams else 0.0,
      "top_token_share": (collections.Counter(tokens).most_common(1)[0][1] / len(tokens)
                          if tokens else 0.0),
  }


def mean_stats(samples: list[dict]) -> dict[str, float]:
  """The mean of each repetition score over the samples."""
  return {k: float(np.mean([s[k] for s in samples])) for k in REPETITION_SCORES}


# --- Curves -----------------------------------------------------------------------


def _smooth(values: np.ndarray) -> np.ndarray:
  """Centred moving average over about 1/25 of the run, skipping missing (NaN) values."""
  width = max(3, len(values) // 25) | 1
  if width > len(values):  # a short run (one stopped early): at most its own length, odd
    width = max(1, len(values) - 1 + len(values) % 2)
  finite = np.isfinite(values)
  kernel = np.ones(width)
  sums = np.convolve(np.where(finite, values, 0.0), kernel, mode="same")
  counts = np.convolve(finite.astype(float), kernel, mode="same")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def plot_run(records: list[dict], path: str, *, max_norm: float, title: str) -> None:
  """Three panels: loss (total and per source; orange lines at spikes), pre-clip grad norm
  (clipped steps, spikes circled, the running mean), source weights; dotted lines at the
  phase boundaries."""
  steps = [r for r in records if r["kind"] == "step"]
  phases = [r for r in records if r["kind"] == "phase"]
  step_S = np.array([r["step"] for r in steps])
  loss_S = np.array([r["loss"] for r in steps])
  norm_S = np.array([r["grad_norm"] for r in steps])
  clipped_S = np.array([bool(r["clipped"]) for r in steps])
  spike_S = np.array([bool(r.get("spike")) for r in steps])
  mean_S = np.array([r.get("norm_mean", 0.0) for r in steps])
  boundaries = [p["step"] for p in phases[1:]]

  fig, (ax_loss, ax_norm, ax_weights) = plt.subplots(
      3, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]})
  fig.suptitle(title)

  ax_loss.plot(step_S, loss_S, color="0.75", lw=0.8, label="loss (batch)")
  ax_loss.plot(step_S, _smooth(loss_S), color="black", lw=1.6, label="loss (smoothed)")
  for name, color in SOURCE_COLORS.items():
    per_source = np.array(
        [np.nan if r["loss_by_source"].get(name) is None else r["loss_by_source"][name]
         for r in steps], dtype=float)
    ax_loss.plot(step_S, _smooth(per_source), color=color, lw=1.1,
                 label=f"{name} (smoothed)")
  ax_loss.set_ylabel("training loss (nats)")
  ax_loss.legend(loc="upper right", fontsize=8)

  ax_norm.semilogy(step_S, norm_S, color="tab:purple", lw=1.0, label="pre-clip global norm")
  if max_norm > 0:
    ax_norm.axhline(max_norm, color="tab:red", ls="--", lw=1.2,
                    label=f"max_norm = {max_norm:g}")
    ax_norm.scatter(step_S[clipped_S], norm_S[clipped_S], color="tab:red", marker="x",
                    s=14, zorder=3,
                    label=f"clipped ({clipped_S.sum()} of {len(step_S)} steps)")
  if np.any(mean_S > 0):
    ax_norm.plot(step_S[mean_S > 0], mean_S[mean_S > 0], color="tab:green", lw=1.0,
                 label="running mean (ZScoreSpike)")
  if spike_S.any():
    ax_norm.scatter(step_S[spike_S], norm_S[spike_S], facecolors="none",
                    edgecolors="tab:orange", marker="o", s=60, zorder=4,
                    label=f"spike ({spike_S.sum()} steps)")
    for s in step_S[spike_S]:
      ax_loss.axvline(s, color="tab:orange", lw=0.6, alpha=0.6)
  ax_norm.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
  ax_norm.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  ax_norm.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax_norm.set_ylabel("gradient norm (log)")
  ax_norm.legend(loc="upper right", fontsize=8)

  if phases:
    edges = [p["step"] for p in phases] + [int(step_S[-1]) + 1]
    weights_PxK = np.array([[p["weights"][n] for n in SOURCE_COLORS] for p in phases])
    ax_weights.stackplot(
        edges, np.vstack([weights_PxK, weights_PxK[-1:]]).T, step="post",
        colors=list(SOURCE_COLORS.values()), alpha=0.8)
    ax_weights.set_ylim(0, 1)
  ax_weights.set_ylabel("source weights\n(colours as above)")
  ax_weights.set_xlabel("step (dotted lines: phase boundaries)")

  for ax in (ax_loss, ax_norm, ax_weights):
    for b in boundaries:
      ax.axvline(b, color="0.6", ls=":", lw=0.7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
