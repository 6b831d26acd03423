"""The documents' stability claim: the unclipped v1 recipe against the clipped v2, by model size.

Every run has the same seed, so the same initial weights, phase boundaries and data
draws (the bandit's weights then follow each run's own losses):

  v1             no clipping, Adam without weight decay, no warmup
  v2             andrea_clip(1.0) ahead of AdamW (weight decay 0.1), linear warmup
  v2-per-tensor  v2 with every tensor clipped by its own norm (--clip-mode per_tensor)
  v2-zscore      v2 with spikes of the norm clipped to their threshold (--spike zscore)
  v2-skip        v2-zscore with spike and NaN/inf steps skipped (--spike skip)

From the per-step metrics it counts gradient-norm spikes (a norm above --spike-factor
times the median of the previous --spike-window norms), how many fall within
--boundary-radius steps of a phase boundary against the count expected if spikes were
uniform over the steps, the largest norm, the loss, the share of clipped steps; from the
samples generated at the end, repetition lock-in (mean top_token_share or repeat_4 above
--lock-in). report.md says in words what the numbers show, including where they differ
from the documents. Runs go to OUT_DIR/CONFIG-VARIANT; the report covers every finished
run in OUT_DIR, so runs made by separate commands can be reported together
(--report-only rebuilds it without training).

    python examples/experiments/exp_v1_vs_v2.py --configs tiny \
        --per-tensor-configs tiny --steps 100 --out-dir runs/exp-v1-vs-v2-cpu   # CPU, minutes
    # One H200, each command under 10 minutes, all into one --out-dir:
    python examples/experiments/exp_v1_vs_v2.py --configs andrea-12m \
        --per-tensor-configs '' --steps 3000
    python examples/experiments/exp_v1_vs_v2.py --configs andrea-120m --variants v1 \
        --per-tensor-configs '' --steps 2500   # then --variants v2, then --variants ''
    python examples/experiments/exp_v1_vs_v2.py --report-only          # all of them
"""

import argparse
import math
import os
import sys

import matplotlib
import numpy as np

if __name__ == "__main__":  # run as a script: the example's package is one folder up
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import exp_common  # noqa: E402
from gpt import config  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

VARIANTS = {
    "v1": dict(recipe="v1", warmup_steps=None),  # None: the recipe's 0, whatever --warmup-steps
    "v2": dict(recipe="v2"),
    "v2-per-tensor": dict(recipe="v2", clip_mode="per_tensor"),
    "v2-zscore": dict(recipe="v2", spike="zscore"),
    "v2-skip": dict(recipe="v2", spike="skip"),
}
COLORS = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")  # one per variant
assert len(COLORS) >= len(VARIANTS)
MIN_HISTORY = 10  # a step is tested for a spike once this many earlier norms are known
SAMPLE_CHARS = 400


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default="andrea-12m,andrea-120m")
  p.add_argument("--variants", default="v1,v2,v2-zscore,v2-skip",
                 help=f"of {', '.join(VARIANTS)}")
  p.add_argument("--per-tensor-configs", default="andrea-120m",
                 help="configs that also run v2-per-tensor ('' for none)")
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--clip-impl", default="auto", choices=config.CHOICES["clip_impl"],
                 help="andrea_clip's impl in v2 (and the norm v1 logs)")
  p.add_argument("--spike-factor", type=float, default=5.0)
  p.add_argument("--spike-window", type=int, default=50)
  p.add_argument("--boundary-radius", type=int, default=3)
  exp_common.add_report_flags(p, "runs/exp-v1-vs-v2")
  exp_common.add_train_flags(p)
  return p.parse_args(argv)


# --- Analysis -----------------------------------------------------------------------


def running_median_ratio(norm_S: np.ndarray, window: int) -> np.ndarray:
  """norm / median of the previous `window` finite norms (NaN without MIN_HISTORY of them)."""
  ratio_S = np.full(len(norm_S), np.nan)
  for t in range(len(norm_S)):
    history = norm_S[max(0, t - window):t]
    history = history[np.isfinite(history)]
    if len(history) >= MIN_HISTORY:
      ratio_S[t] = norm_S[t] / np.median(history)
  return ratio_S


def near_boundary(step_S: np.ndarray, boundary_steps: list[int], radius: int) -> np.ndarray:
  if not boundary_steps:
    return np.zeros(len(step_S), bool)
  distance_S = np.min(np.abs(step_S[:, None] - np.array(boundary_steps)[None, :]), axis=1)
  return distance_S <= radius


def binomial_tail(k: int, n: int, p: float) -> float:
  """P(X >= k) for X ~ Binomial(n, p): how unlikely k boundary spikes are under uniformity."""
  return float(sum(math.comb(n, i) * p**i * (1 - p)**(n - i) for i in range(k, n + 1)))


def analyse(run: dict, args) -> dict:
  records, summary, settings = run["records"], run["summary"], run["config"]
  step_S = exp_common.column(records, "step").astype(int)
  norm_S, loss_S = exp_common.column(records, "grad_norm"), exp_common.column(records, "loss")
  ratio_S = running_median_ratio(norm_S, args.spike_window)
  testable_S = np.isfinite(ratio_S)
  spike_S = testable_S & (ratio_S > args.spike_factor)
  near_S = near_boundary(step_S, exp_common.boundaries(records), args.boundary_radius)
  near_share = float(near_S[testable_S].mean()) if testable_S.any() else 0.0
  num_spikes, num_near = int(spike_S.sum()), int((spike_S & near_S).sum())
  nonfinite = np.flatnonzero(~np.isfinite(loss_S) | ~np.isfinite(norm_S))
  repetition = summary.get("repetition", {})
  return {
      "config": settings["config"], "recipe": settings["recipe"], "seed": settings["seed"],
      "clip_mode": settings["clip_mode"], "max_norm": settings["max_norm"],
      "spike_policy": settings.get("spike", "off"),
      "device_spikes": len(summary.get("spike_steps", [])),
      "skipped_steps": summary.get("skipped_steps", 0),
      "steps": len(step_S), "planned_steps": settings.get("steps") or len(step_S),
      "stopped_by_time_limit": bool(summary.get("stopped_by_time_limit")),
      "warmup_steps": settings["warmup_steps"],
      "phases": len(exp_common.boundaries(records)) + 1,
      "tokens_per_step": settings["batch_size"] * settings["context_length"],
      "initial_loss": float(loss_S[0]),
      "final_loss": exp_common.final_loss(loss_S),
      "first_nonfinite_step": int(step_S[nonfinite[0]]) if len(nonfinite) else None,
      "largest_norm": float(np.nanmax(norm_S)),
      "largest_norm_step": int(step_S[np.nanargmax(norm_S)]),
      "median_norm": float(np.nanmedian(norm_S)),
      "spikes": num_spikes,
      "spike_steps": step_S[spike_S].tolist(),
      "spikes_near_boundary": num_near,
      "spikes_elsewhere": num_spikes - num_near,
      "near_boundary_share_of_steps": near_share,
      "expected_near_if_uniform": num_spikes * near_share,
      "p_value_near": binomial_tail(num_near, num_spikes, near_share) if num_spikes else None,
      "largest_ratio_near_boundary": _nanmax(ratio_S[near_S]),
      "largest_ratio_elsewhere": _nanmax(ratio_S[~near_S]),
      "clipped_share": (float(exp_common.column(records, "clipped").mean())
                        if settings["max_norm"] > 0 else None),
      "repetition": repetition,
      "locked_in": exp_common.locked_in(summary, args.lock_in),
      "diverged": summary.get("diverged"),
      "samples": summary.get("samples", []),
      "median_tokens_per_s": summary.get("median_tokens_per_s"),
      "environment": run["environment"],
  }


def _nanmax(x: np.ndarray) -> float | None:
  x = x[np.isfinite(x)]
  return float(x.max()) if len(x) else None


# --- Report -------------------------------------------------------------------------


def spike_sentence(name: str, a: dict, args) -> str:
  near = f"within ±{args.boundary_radius} steps of a phase boundary"
  if a["spikes"] == 0:
    return f"{name}: no spikes (no norm above {args.spike_factor:g}x its running median)."
  text = (f"{name}: {a['spikes']} spike{'s' * (a['spikes'] != 1)}, "
          f"{a['spikes_near_boundary']} {near} where "
          f"{a['expected_near_if_uniform']:.1f} would be if they were uniform "
          f"({a['near_boundary_share_of_steps']:.0%} of the steps are that close)")
  ratio = a["spikes_near_boundary"] / max(a["expected_near_if_uniform"], 1e-9)
  if a["p_value_near"] is not None and a["p_value_near"] < 0.05:
    return text + (f": {ratio:.1f}x the uniform count (p = {a['p_value_near']:.2g}), "
                   "so the spikes cluster at the source switches, as the documents say.")
  if a["spikes_near_boundary"] > a["expected_near_if_uniform"]:
    return text + (f": more than uniform, but not significantly (p = "
                   f"{a['p_value_near']:.2g}); the runs do not show that spikes come "
                   "from the source switches.")
  return text + ": no more than uniform, so these spikes are not tied to the switches."


def lock_in_findings(by_run: dict, args) -> list[str]:
  """The documents' size claim: v1 locks in at 120M while 12M survives."""
  v1 = {cfg: by_run.get(f"{cfg}-v1") for cfg in ("andrea-12m", "andrea-120m")}
  judged = lambda a: a["locked_in"] is not None or a["first_nonfinite_step"] is not None
  if not all(v1.values()) or not all(judged(a) for a in v1.values()):
    return ["The size claim (v1 locks in at 120M, 12M survives) needs v1 runs with samples "
            "of both andrea-12m and andrea-120m; these results do not have both."]
  small, big = v1["andrea-12m"], v1["andrea-120m"]

  def describe(a):
    shown = ", ".join(f"{k} {a['repetition'][k]:.2f}"
                      for k in ("top_token_share", "repeat_4", "distinct_2")
                      if k in a["repetition"])
    shown = f" ({shown})" if shown else ""
    if a["first_nonfinite_step"] is not None:
      return f"diverged: non-finite loss from step {a['first_nonfinite_step']}{shown}"
    return ("locked in" if a["locked_in"] else "no lock-in") + shown

  failed = lambda a: a["locked_in"] or a["first_nonfinite_step"] is not None
  reproduced = failed(big) and not failed(small)
  if reproduced:
    verdict = "Reproduced" if big["locked_in"] else "Partly reproduced (a divergence, not lock-in)"
    lines = [f"{verdict}: v1 at andrea-120m {describe(big)}; at andrea-12m {describe(small)}."]
  elif failed(big):
    lines = [f"Not reproduced: v1 fails at both sizes (120M {describe(big)}; 12M "
             f"{describe(small)}), so these runs show no threshold between 12M and 120M."]
  else:
    lines = [f"Not reproduced: v1 at andrea-120m shows {describe(big)}; the lock-in "
             f"threshold is {args.lock_in:g}. At andrea-12m: {describe(small)}."]
  for cfg in ("andrea-12m", "andrea-120m"):
    v2 = by_run.get(f"{cfg}-v2")
    if v2 and v2["locked_in"]:
      lines.append(f"v2 at {cfg} also meets the lock-in definition, so at this length the "
                   "metric sees an undertrained model's repetition, not only a collapse.")
  if not (reproduced and big["locked_in"]):
    reasons = [f"steps: {big['steps']} here ({big['phases']} phases); the "
               "documents describe drift that built up over many phases of a longer run "
               "and give no step count"]
    reasons.append("data: " + ("the default corpus, about 0.5 MB of Python documentation "
                               "per source, not the documents' sources" if not
                               big.get("custom_data") else "the sources given with --source, "
                               "not necessarily the documents'"))
    reasons.append(f"scale: {big['tokens_per_step']:,} tokens per step at 120M; the "
                   "documents give no batch size, and a larger batch averages outlier "
                   "sequences away")
    lines.append("Why that may be: " + "; ".join(reasons) + ".")
  return lines


def write_report(env, by_run: dict, args) -> str:
  lines = ["# v1 (no clipping) vs v2 (andrea_clip 1.0): the documents' stability claim\n",
           f"Report: `{env['command']}` ({env['date']}). Runs:\n"]
  lines += exp_common.made_by({name: a["environment"] for name, a in by_run.items()})
  seeds = sorted({a["seed"] for a in by_run.values()})
  lines += ["", (f"Every run has seed {seeds[0]}: the same initial weights, phase boundaries "
                 "and data draws (the bandit's weights follow each run's own losses). "
                 if len(seeds) == 1 else f"The runs have different seeds ({seeds}). ") +
            f"A spike is "
           f"a pre-clip global norm above {args.spike_factor:g}x the median of the previous "
           f"{args.spike_window} steps (tested from step {MIN_HISTORY + 1}); \"near\" is within "
           f"±{args.boundary_radius} steps of a phase boundary; lock-in is a mean "
           f"top_token_share or repeat_4 of the samples above {args.lock_in:g}.\n"]
  header = ["run", "steps", "loss first -> last 10", "largest norm (step)", "median norm",
            "spikes (near / expected / elsewhere)", "max ratio near / elsewhere",
            "clipped", "ZScoreSpike spikes / skipped", "top_token_share", "repeat_4",
            "locked in"]
  rows = []
  for name, a in by_run.items():
    rep = a["repetition"]
    rows.append([
        name, _steps_cell(a), f"{a['initial_loss']:.3f} -> {exp_common.fmt(a['final_loss'], 4)}"
        + (f" (non-finite at {a['first_nonfinite_step']})" if a["first_nonfinite_step"] else ""),
        f"{a['largest_norm']:.3g} ({a['largest_norm_step']})", f"{a['median_norm']:.3g}",
        f"{a['spikes']} ({a['spikes_near_boundary']} / {a['expected_near_if_uniform']:.1f} / "
        f"{a['spikes_elsewhere']})",
        f"{exp_common.fmt(a['largest_ratio_near_boundary'])} / "
        f"{exp_common.fmt(a['largest_ratio_elsewhere'])}",
        "n/a" if a["clipped_share"] is None else f"{a['clipped_share']:.1%}",
        "n/a" if a["spike_policy"] == "off" else f"{a['device_spikes']} / {a['skipped_steps']}",
        exp_common.fmt(rep.get("top_token_share"), 2), exp_common.fmt(rep.get("repeat_4"), 2),
        exp_common.fmt(a["locked_in"])])
  lines += [exp_common.md_table(header, rows), "", "## What the runs show\n"]
  for name, a in by_run.items():
    lines.append("- " + spike_sentence(name, a, args))
  configs = sorted({a["config"] for a in by_run.values()})
  for cfg in configs:
    v1, v2 = by_run.get(f"{cfg}-v1"), by_run.get(f"{cfg}-v2")
    if v1 and v2:
      lines.append("- " + _recipe_sentence(cfg, v1, v2))
    pt = by_run.get(f"{cfg}-v2-per-tensor")
    if v2 and pt:
      lines.append("- " + _per_tensor_sentence(cfg, v2, pt))
  lines += ["", "## Against the documents\n"]
  lines += ["- " + line for line in lock_in_findings(by_run, args)]
  lines += ["- The documents put boundary gradients at 10x-100x their typical size. Largest "
            "norm / running median within the boundary window: " + ", ".join(
                f"{name} {exp_common.fmt(a['largest_ratio_near_boundary'])}"
                for name, a in by_run.items()) + "."]
  lines.append("")
  for cfg in configs:
    lines.append(f"![{cfg}]({cfg}.png)\n")
  lines.append("## Samples\n")
  for name, a in by_run.items():
    for s in a["samples"]:
      text = (s["prompt"] + s["text"])[:SAMPLE_CHARS].replace("```", "'''")
      lines.append(f"{name}: distinct_2 {s['distinct_2']:.2f}, repeat_4 {s['repeat_4']:.2f}, "
                   f"top_token_share {s['top_token_share']:.2f}\n```\n{text}\n```\n")
  return "\n".join(lines) + "\n"


def _steps_cell(a) -> str:
  if a["steps"] == a["planned_steps"]:
    return str(a["steps"])
  why = " (time limit)" if a["stopped_by_time_limit"] else ""
  return f"{a['steps']} of {a['planned_steps']}{why}"


def _recipe_sentence(cfg, v1, v2) -> str:
  diverged = (f"v1 went non-finite at step {v1['first_nonfinite_step']}; "
              if v1["first_nonfinite_step"] else "")
  lower = "v2" if (v1["final_loss"] is None or v2["final_loss"] < v1["final_loss"]) else "v1"
  return (f"{cfg}: {diverged}final loss v1 {exp_common.fmt(v1['final_loss'], 4)}, v2 "
          f"{exp_common.fmt(v2['final_loss'], 4)} ({lower} lower); largest norm v1 "
          f"{v1['largest_norm']:.3g}, v2 {v2['largest_norm']:.3g}; v2 clipped "
          f"{v2['clipped_share']:.1%} of its steps (warmup {v2['warmup_steps']} of "
          f"{v2['steps']} steps).")


def _per_tensor_sentence(cfg, v2, pt) -> str:
  return (f"{cfg}, global vs per-tensor clipping: final loss "
          f"{exp_common.fmt(v2['final_loss'], 4)} vs {exp_common.fmt(pt['final_loss'], 4)}; "
          f"steps with any clipping {v2['clipped_share']:.1%} vs {pt['clipped_share']:.1%}; "
          f"spikes {v2['spikes']} vs {pt['spikes']}; largest norm {v2['largest_norm']:.3g} vs "
          f"{pt['largest_norm']:.3g}; locked in: {exp_common.fmt(v2['locked_in'])} vs "
          f"{exp_common.fmt(pt['locked_in'])}.")


def plot_config(path: str, cfg: str, runs: dict, analyses: dict) -> None:
  fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
  fig.suptitle(f"{cfg}: same seed and bandit schedule")
  for (name, run), color in zip(runs.items(), COLORS):
    step_S = exp_common.column(run["records"], "step")
    loss_S, norm_S = (exp_common.column(run["records"], k) for k in ("loss", "grad_norm"))
    ax_loss.plot(step_S, loss_S, color=color, alpha=0.25, lw=0.6)
    ax_loss.plot(step_S, exp_common.smooth(loss_S, 25), color=color, lw=1.4, label=name)
    ax_norm.semilogy(step_S, norm_S, color=color, lw=0.7, label=name)
    spikes = np.array(analyses[name]["spike_steps"], int)
    ax_norm.scatter(spikes, norm_S[spikes - 1], color=color, marker="x", s=20, zorder=3)
  boundary_steps = exp_common.boundaries(next(iter(runs.values()))["records"])
  for ax in (ax_loss, ax_norm):
    for b in boundary_steps[:400]:
      ax.axvline(b, color="0.85", lw=0.5, zorder=0)
    ax.legend(fontsize=8, loc="upper right")
  ax_loss.set_ylabel("training loss")
  ax_norm.set_ylabel("pre-clip global norm (x: spikes)")
  ax_norm.set_xlabel("step (grey: phase boundaries)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  configs = exp_common.split_list(args.configs)
  planned = [(cfg, v) for cfg in configs for v in exp_common.split_list(args.variants)]
  planned += [(cfg, "v2-per-tensor") for cfg in exp_common.split_list(args.per_tensor_configs)
              if (cfg, "v2-per-tensor") not in planned]
  env = exp_common.environment("exp_v1_vs_v2.py", argv)
  if not args.report_only:
    for cfg, variant in planned:
      exp_common.run_training(exp_common.base_config(
          args, cfg, steps=args.steps, clip_impl=args.clip_impl,
          out_dir=os.path.join(args.out_dir, f"{cfg}-{variant}"), **VARIANTS[variant]), env)
  runs = {}
  for cfg in config.PRESETS:
    for variant in VARIANTS:
      if (run := exp_common.read_run(os.path.join(args.out_dir, f"{cfg}-{variant}"))):
        runs[f"{cfg}-{variant}"] = run
  by_run = {name: analyse(run, args) for name, run in runs.items()}
  for name, run in runs.items():
    by_run[name]["custom_data"] = bool(run["config"]["sources"])
  for cfg in sorted({a["config"] for a in by_run.values()}):
    plot_config(os.path.join(args.out_dir, f"{cfg}.png"), cfg,
                {n: r for n, r in runs.items() if by_run[n]["config"] == cfg}, by_run)
  findings = lock_in_findings(by_run, args)
  results = {"environment": env, "definitions": {
      "spike_factor": args.spike_factor, "spike_window": args.spike_window,
      "min_history": MIN_HISTORY, "boundary_radius": args.boundary_radius,
      "lock_in": args.lock_in}, "runs": by_run, "size_claim": findings}
  markdown = write_report(env, by_run, args)
  exp_common.write_outputs(args.out_dir, results, markdown)
  print(markdown)
  return results


if __name__ == "__main__":
  exp_common.run_cli(main)
