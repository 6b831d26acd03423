"""The pure-JAX clip (the TPU and CPU path) against the custom call, in the example's training.

Two measurements, written to OUT_DIR/report.md, results.json and PNG plots:

1. Equivalence. The example trains once per --clip-impls entry (an impl named twice runs
   twice: the control for how far two runs of one path drift) with the same seed, data
   and bandit schedule, and only andrea_clip's `impl` changed. Per step: the pre-clip
   norms (relative difference), the losses (difference), and whether the same steps
   were clipped. The first impl is the reference.
2. Time. The example's jitted, donated training step on one fixed batch, with each
   clip and with --max-norm 0 (Adam only; the example still computes the norm for its
   log); and the clip alone on the model's real gradient tree, once with a max_norm
   below the norm (every call scales every element) and once above it (nothing is
   scaled), --clip-reps clips per jitted call. Medians over --time-steps after
   --time-warmup.

On a GPU `impl="ffi"` is the CUDA custom call; on a CPU it is the custom call's CPU
handler, so the same script runs small anywhere:

    python examples/experiments/exp_fallback_vs_cuda.py --configs tiny --steps 100 \
        --time-configs tiny --out-dir runs/exp-fallback-vs-ffi-cpu      # CPU, minutes
    python examples/experiments/exp_fallback_vs_cuda.py --configs andrea-12m --steps 1500 \
        --time-configs andrea-12m,andrea-120m                           # one H200
"""

import argparse
import dataclasses
import os
import sys
import statistics
import time

import clipjax
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

if __name__ == "__main__":  # run as a script: the example's package is one folder up
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import exp_common  # noqa: E402
from gpt import config, model as model_lib  # noqa: E402
from gpt.reports import metrics  # noqa: E402
from gpt.training import loop, train_step as train_step_lib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

SCALE_EVERY_CLIP = 0.999  # max_norm shrinks by this each clip, so every clip scales
NEVER_CLIPS = 1e30


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default="andrea-12m", help="equivalence runs (comma list)")
  p.add_argument("--steps", type=int, default=1500, help="steps of every equivalence run")
  p.add_argument("--clip-impls", default="jax,ffi",
                 help="the first is the reference; an impl named again (jax,ffi,jax) runs "
                      "again as a control of run-to-run variation")
  p.add_argument("--time-configs", default="andrea-12m,andrea-120m",
                 help="configs whose step and clip are timed ('' for none)")
  p.add_argument("--time-steps", type=int, default=50)
  p.add_argument("--clip-reps", type=int, default=20,
                 help="clips per jitted call when the clip is timed alone")
  p.add_argument("--time-warmup", type=int, default=5)
  p.add_argument("--out-dir", default="runs/exp-fallback-vs-cuda")
  exp_common.add_train_flags(p)
  p.set_defaults(num_samples=0)
  return p.parse_args(argv)


# --- Equivalence --------------------------------------------------------------------


def compare(ref_records: list[dict], other_records: list[dict]) -> dict:
  norm_ref, norm = (exp_common.column(r, "grad_norm") for r in (ref_records, other_records))
  loss_ref, loss = (exp_common.column(r, "loss") for r in (ref_records, other_records))
  clip_ref, clip = (exp_common.column(r, "clipped") > 0 for r in (ref_records, other_records))
  n = min(len(norm_ref), len(norm))  # the common steps, should a run have ended early
  norm_ref, norm, loss_ref, loss, clip_ref, clip = (
      x[:n] for x in (norm_ref, norm, loss_ref, loss, clip_ref, clip))
  rel_S = np.abs(norm - norm_ref) / np.abs(norm_ref)
  loss_diff_S = np.abs(loss - loss_ref)
  mismatch = np.flatnonzero(clip_ref != clip) + 1
  return {
      "steps": len(norm_ref),
      "step1_norm_rel_diff": float(rel_S[0]),
      "max_norm_rel_diff": float(np.max(rel_S)),
      "max_norm_rel_diff_step": int(np.argmax(rel_S)) + 1,
      "median_norm_rel_diff": float(np.median(rel_S)),
      "max_loss_abs_diff": float(np.max(loss_diff_S)),
      "max_loss_abs_diff_step": int(np.argmax(loss_diff_S)) + 1,
      "final_loss": [float(np.mean(loss_ref[-10:])), float(np.mean(loss[-10:]))],
      "clipped_steps": [int(clip_ref.sum()), int(clip.sum())],
      "clipped_mismatch_count": int(len(mismatch)),
      "clipped_mismatch_steps": mismatch[:20].tolist(),
      "norm_rel_diff_per_step": rel_S.tolist(),
  }


def plot_equivalence(path, name, impls, runs, max_norm):
  step_S = np.arange(1, len(metrics.step_records(runs[impls[0]])) + 1)
  fig, (ax_loss, ax_norm, ax_diff) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
  fig.suptitle(f"{name}: andrea_clip impl " + " vs ".join(impls) + ", same seed and data")
  for impl, style in zip(impls, ("-", "--", ":")):
    loss_S = exp_common.column(runs[impl], "loss")
    ax_loss.plot(np.arange(1, len(loss_S) + 1), loss_S, ls=style, lw=1, label=impl)
    norm_S = exp_common.column(runs[impl], "grad_norm")
    ax_norm.semilogy(np.arange(1, len(norm_S) + 1), norm_S, ls=style, lw=1, label=impl)
  ax_norm.axhline(max_norm, color="tab:red", lw=0.8, ls="--", label=f"max_norm {max_norm:g}")
  ref = impls[0]
  for impl in impls[1:]:
    d = compare(runs[ref], runs[impl])
    n = d["steps"]
    ax_diff.semilogy(step_S[:n], np.maximum(d["norm_rel_diff_per_step"], 1e-12), lw=0.8,
                     label=f"|norm {impl} - {ref}| / norm {ref}")
    loss_diff = np.abs(exp_common.column(runs[impl], "loss")[:n] -
                       exp_common.column(runs[ref], "loss")[:n])
    ax_diff.semilogy(step_S[:n], np.maximum(loss_diff, 1e-12), lw=0.8,
                     label=f"|loss {impl} - {ref}|")
  ax_loss.set_ylabel("training loss")
  ax_norm.set_ylabel("pre-clip global norm")
  ax_diff.set_ylabel("difference (1e-12: equal)")
  ax_diff.set_xlabel("step")
  for ax in (ax_loss, ax_norm, ax_diff):
    ax.legend(fontsize=8, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- Time ---------------------------------------------------------------------------


def median_ms(calls: dict, reps: int, warmup: int) -> dict[str, float]:
  """Median milliseconds of each call(i); the calls take turns, so a slow spell of a
  shared machine falls on all of them alike."""
  times = {label: [] for label in calls}
  for i in range(warmup + reps):
    for label, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call(i))
      if i >= warmup:
        times[label].append(1e3 * (time.perf_counter() - start))
  return {label: statistics.median(t) for label, t in times.items()}


def time_config(args, name: str, impls: list[str]) -> dict:
  cfg = config.resolve(exp_common.base_config(args, name, steps=args.time_steps))
  graphdef, params = loop.init_model(cfg)
  tokens_BxL1 = jax.random.randint(jax.random.key(cfg.seed),
                                   (cfg.batch_size, cfg.context_length + 1), 0, cfg.vocab_size)
  source_B = jnp.zeros((cfg.batch_size,), jnp.int32)

  def training_step(variant: config.TrainConfig):
    """The example's jitted, donated step, carrying its own parameters and Adam state."""
    tx = train_step_lib.make_optimizer(variant)
    step = train_step_lib.make_train_step(graphdef, tx, variant, num_sources=3)
    carry = [jax.tree.map(jnp.copy, params), tx.init(params)]

    def call(i):
      carry[0], carry[1], step_metrics = step(carry[0], carry[1], tokens_BxL1, source_B,
                                              jnp.int32(i + 1))
      return carry[0], carry[1], step_metrics

    return call

  steps = {"no clip": training_step(dataclasses.replace(cfg, max_norm=0.0,
                                                         clip_impl=impls[0]))}
  steps.update({impl: training_step(dataclasses.replace(cfg, clip_impl=impl))
                for impl in impls})
  step_ms = median_ms(steps, args.time_steps, args.time_warmup)
  del steps

  def loss_fn(params):  # training's loss (train_step.py)
    model = nnx.merge(graphdef, params)
    return model.token_losses(tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]).mean()

  grads = jax.jit(jax.grad(loss_fn))(params)
  norm0 = float(clipjax.global_norm(grads, impl="jax"))

  reps = args.clip_reps

  def clip_alone(impl: str, first_max_norm, factor):
    """`reps` clips in one jitted, donated call (a fori_loop: each clips the last one's
    output with max_norm * factor**k), so that the call's dispatch is shared by `reps`."""
    def clips(g, m):
      body = lambda k, g: clipjax.clip_tree(g, m * factor ** k, impl=impl).updates
      return jax.lax.fori_loop(0, reps, body, g)

    clip = jax.jit(clips, donate_argnums=0)
    tree = [jax.tree.map(jnp.copy, grads)]

    def call(i):
      tree[0] = clip(tree[0], jnp.float32(first_max_norm(i)))
      return tree[0]

    return call

  clips = {}
  for impl in impls:
    clips[(impl, "clips")] = clip_alone(
        impl, lambda i: norm0 * SCALE_EVERY_CLIP ** (i * reps + 1), SCALE_EVERY_CLIP)
    clips[(impl, "passes")] = clip_alone(impl, lambda i: NEVER_CLIPS, 1.0)
  clip_ms = {key: ms / reps for key, ms in
             median_ms(clips, args.time_steps, args.time_warmup).items()}
  return {"params": model_lib.count_params(params), "leaves": len(jax.tree.leaves(params)),
          "tokens_per_step": cfg.batch_size * cfg.context_length, "step_ms": step_ms,
          "clip_alone_ms": {impl: {regime: clip_ms[(impl, regime)]
                                   for regime in ("clips", "passes")} for impl in impls}}


def plot_timing(path, timing: dict, impls: list[str]) -> None:
  names = list(timing)
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
  for ax, name in zip(axes[0], names):
    t = timing[name]
    labels = ["step, no clip"] + [f"step, {i}" for i in impls] + [
        f"clip alone, {i}" for i in impls]
    values = ([t["step_ms"]["no clip"]] + [t["step_ms"][i] for i in impls] +
              [t["clip_alone_ms"][i]["clips"] for i in impls])
    ax.barh(labels, values, color=["0.6"] + ["tab:blue"] * len(impls) +
            ["tab:orange"] * len(impls))
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.set_title(f"{name} ({t['params'] / 1e6:.1f}M parameters)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- Report -------------------------------------------------------------------------


def write_report(args, env, labels, timed, equivalence, timing) -> str:
  """`labels`: the equivalence runs, the first the reference; `timed`: the timed impls."""
  ffi_is = "the CUDA custom call" if env["platform"] == "gpu" else (
      f"the custom call's {env['platform'].upper()} handler")
  lines = ["# andrea_clip: pure JAX (the TPU/CPU fallback) vs the custom call\n",
           f"`{env['command']}`\n",
           f"{env['date']}; {env['device']} ({env['platform']}); jax {env['jax']}. "
           f"Here `impl=\"ffi\"` is {ffi_is}; `impl=\"jax\"` is the pure-JAX path that TPUs "
           f"and CPUs take. Seed {args.seed} for every run.\n"]
  if equivalence:
    lines.append("## Same training, two implementations\n")
    impls = exp_common.split_list(args.clip_impls)
    repeats = [label for label in labels if label not in impls]
    if repeats:
      lines.append(", ".join(f"`{r}`" for r in repeats) + " repeat" + "s" * (len(repeats) == 1)
                   + " an impl with the same seed and data: the control, how far two runs "
                   "of one path drift apart on this machine.\n")
    rows = []
    for name, by_impl in equivalence.items():
      for impl, d in by_impl.items():
        rows.append([name, f"{labels[0]} vs {impl}", d["steps"], f"{d['step1_norm_rel_diff']:.2e}",
                     f"{d['max_norm_rel_diff']:.2e} (step {d['max_norm_rel_diff_step']})",
                     f"{d['max_loss_abs_diff']:.2e} (step {d['max_loss_abs_diff_step']})",
                     f"{d['clipped_steps'][0]} / {d['clipped_steps'][1]}",
                     d["clipped_mismatch_count"]])
    lines.append(exp_common.md_table(
        ["config", "impls", "steps", "norm rel. diff, step 1", "max norm rel. diff",
         "max loss diff", "clipped steps", "steps clipped by one only"], rows))
    lines.append("")
    for name, by_impl in equivalence.items():
      for impl, d in by_impl.items():
        lines.append(_equivalence_sentence(name, labels[0], impl, d))
      lines.append(f"\n![{name}]({name}-equivalence.png)\n")
  if timing:
    lines.append("## Time of the training step and of the clip\n")
    rows = []
    for name, t in timing.items():
      base = t["step_ms"]["no clip"]
      for impl in timed:
        step_ms, alone = t["step_ms"][impl], t["clip_alone_ms"][impl]
        rows.append([name, impl, f"{base:.3g}", f"{step_ms:.3g}",
                     f"{step_ms - base:+.3g} ({100 * (step_ms - base) / step_ms:+.1f}%)",
                     f"{alone['clips']:.3g} ({100 * alone['clips'] / step_ms:.1f}%)",
                     f"{alone['passes']:.3g}",
                     f"{t['tokens_per_step'] / step_ms * 1e3:,.0f}"])
    lines.append(exp_common.md_table(
        ["config", "clip impl", "step without clip (ms)", "step with clip (ms)",
         "difference (share of the step)", "clip alone, scaling (ms, share)",
         "clip alone, passing (ms)", "tokens/s with clip"], rows))
    lines.append(f"\nMedians over {args.time_steps} calls after {args.time_warmup} warm-up "
                 "calls, one fixed batch; the variants take turns call by call. \"Step "
                 "without clip\" is the example's step with "
                 "`--max-norm 0`: Adam only, but it still computes the global norm for the "
                 "log, so the difference understates the clip; \"clip alone\" is "
                 f"`clip_tree` on the model's gradient tree, {args.clip_reps} clips per "
                 "jitted, donated call (a fori_loop), per clip, with max_norm below the norm "
                 "(every element is scaled) or above it.\n")
    for name, t in timing.items():
      lines.append(_timing_sentence(name, timed, t))
    lines.append("\n![timing](timing.png)\n")
  return "\n".join(lines) + "\n"


def _equivalence_sentence(name, ref, impl, d) -> str:
  if d["max_norm_rel_diff"] < 1e-5:
    agree = (f"{name}: over {d['steps']} steps the pre-clip norms of `{impl}` and `{ref}` "
             f"agree to {d['max_norm_rel_diff']:.1e} (float32 rounding) and the losses to "
             f"{d['max_loss_abs_diff']:.1e}.")
  else:
    agree = (f"{name}: at step 1 (same parameters, same batch) the norms differ by "
             f"{d['step1_norm_rel_diff']:.1e}, the clip's own difference; by step "
             f"{d['max_norm_rel_diff_step']} the difference reaches "
             f"{d['max_norm_rel_diff']:.1e}, and the losses differ by up to "
             f"{d['max_loss_abs_diff']:.1e}: the two paths sum squares in different orders "
             "and precisions, the parameters drift apart by rounding, and training "
             "amplifies the drift.")
  if d["clipped_mismatch_count"] == 0:
    clipped = f" The same {d['clipped_steps'][0]} steps were clipped."
  else:
    clipped = (f" {d['clipped_mismatch_count']} steps were clipped by one and not the "
               f"other (first: {d['clipped_mismatch_steps'][:5]}), steps whose norm is "
               "within that difference of max_norm.")
  loss_gap = d["final_loss"][1] - d["final_loss"][0]
  return agree + clipped + (f" Final loss (mean of the last 10 steps): {d['final_loss'][0]:.4f} "
                            f"vs {d['final_loss'][1]:.4f} ({loss_gap:+.1e}).")


def _timing_sentence(name, impls, t) -> str:
  parts = [f"{name} ({t['params'] / 1e6:.1f}M parameters, {t['leaves']} leaves):"]
  base = t["step_ms"]["no clip"]
  for impl in impls:
    alone, step_ms = t["clip_alone_ms"][impl]["clips"], t["step_ms"][impl]
    parts.append(f"with `{impl}` the clip alone takes {alone:.3g} ms, "
                 f"{100 * alone / step_ms:.1f}% of its {step_ms:.3g} ms step" +
                 (" (which was no slower than the step without a clip: the difference is "
                  "below the timing noise);" if step_ms <= base else ";"))
  if len(impls) > 1:
    a, b = (t["clip_alone_ms"][i]["clips"] for i in impls[:2])
    faster, ratio = (impls[1], a / b) if b < a else (impls[0], b / a)
    parts.append(f"the clip is {ratio:.2g}x faster with `{faster}`.")
  return " ".join(parts)


def run_labels(impls: list[str]) -> list[str]:
  """One label per run: the impl, and impl-2, impl-3 ... for its repeats (controls)."""
  seen: dict[str, int] = {}
  labels = []
  for impl in impls:
    seen[impl] = seen.get(impl, 0) + 1
    labels.append(impl if seen[impl] == 1 else f"{impl}-{seen[impl]}")
  return labels


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  impls = exp_common.split_list(args.clip_impls)
  labels = run_labels(impls)
  env = exp_common.environment("exp_fallback_vs_cuda.py", argv)
  os.makedirs(args.out_dir, exist_ok=True)
  equivalence = {}
  for name in exp_common.split_list(args.configs):
    runs = {}
    for label, impl in zip(labels, impls):
      cfg = exp_common.base_config(args, name, steps=args.steps, clip_impl=impl,
                                   out_dir=os.path.join(args.out_dir, f"{name}-{label}"))
      runs[label] = exp_common.run_training(cfg, env)
    max_norm = config.resolve(cfg).max_norm
    equivalence[name] = {label: compare(runs[labels[0]], runs[label]) for label in labels[1:]}
    plot_equivalence(os.path.join(args.out_dir, f"{name}-equivalence.png"), name, labels,
                     runs, max_norm)
  timed = list(dict.fromkeys(impls))  # a repeated impl is timed once
  timing = {name: time_config(args, name, timed)
            for name in exp_common.split_list(args.time_configs)}
  if timing:
    plot_timing(os.path.join(args.out_dir, "timing.png"), timing, timed)
  results = {"environment": env, "clip_impls": impls, "run_labels": labels,
             "equivalence": equivalence, "timing": timing}
  markdown = write_report(args, env, labels, timed, equivalence, timing)
  exp_common.write_outputs(args.out_dir, results, markdown)
  print(markdown)
  return results


if __name__ == "__main__":
  exp_common.run_cli(main)
