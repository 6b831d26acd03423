"""The stable range of the peak learning rate, per recipe and model size.

For each config and variant (those of exp_v1_vs_v2.py: v1 is no clipping, Adam, no
warmup; v2 is andrea_clip(1.0) ahead of AdamW with warmup), it trains one run per peak
learning rate, all with one seed (the same initial weights, phase boundaries and first
batches), and calls each run:

  diverged   the loss went NaN/inf (the run stops after --nonfinite-stop such steps), or
             its 50-step moving average ended more than --blowup nats above its lowest
  locked in  the samples generated at the end repeat themselves: a mean top_token_share
             or repeat_4 above --lock-in
  too high   a rate above the best one of its config and variant (the lowest moving-average
             loss) whose own lowest is more than --worse-by nats above the best: it trains,
             but the rate is past what the recipe can use
  stable     none of these

The report gives, per config and variant, the largest stable peak learning rate and the
smallest failing one above it: the edge lies between them. Runs go to
OUT_DIR/CONFIG-VARIANT-lrRATE; the report covers every finished run in OUT_DIR, so
sweeps split over several commands (one per GPU) are reported together.

    python examples/experiments/exp_lr_sweep.py --configs tiny --steps 60 \\
        --lrs 1e-3,1e-2,1e-1 --out-dir runs/exp-lr-sweep-cpu           # CPU, minutes
    # One command per GPU, then --report-only over the shared --out-dir:
    CUDA_VISIBLE_DEVICES=0 python examples/experiments/exp_lr_sweep.py \\
        --configs andrea-12m --variants v1 --steps 1500 --warmup-steps 300 \\
        --lrs 3e-4,1e-3,3e-3,1e-2
"""

import argparse
import os
import re
import sys

import matplotlib
import numpy as np

if __name__ == "__main__":  # run as a script: the example's package is one folder up
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import exp_common  # noqa: E402
import exp_v1_vs_v2  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

SMOOTH_STEPS = 50
RUN_NAME = re.compile(r"^(?P<config>[\w-]+?)-(?P<variant>v[\w-]+)-lr(?P<lr>[0-9.e+-]+)$")


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default="andrea-12m")
  p.add_argument("--variants", default="v1,v2",
                 help=f"of {', '.join(exp_v1_vs_v2.VARIANTS)}")
  p.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2", help="peak learning rates")
  p.add_argument("--steps", type=int, default=1500)
  p.add_argument("--blowup", type=float, default=1.0,
                 help="nats above its lowest point at which a moving-average loss diverged")
  p.add_argument("--worse-by", type=float, default=1.0,
                 help="nats of lowest loss above the best rate's that make a higher rate "
                      "too high")
  exp_common.add_report_flags(p, "runs/exp-lr-sweep")
  exp_common.add_train_flags(p)
  args = p.parse_args(argv)
  if args.peak_lr is not None:
    p.error("--peak-lr: the sweep sets it; give the rates with --lrs")
  for variant in exp_common.split_list(args.variants):
    if variant not in exp_v1_vs_v2.VARIANTS:
      p.error(f"--variants: unknown {variant!r}; choose from "
              f"{', '.join(exp_v1_vs_v2.VARIANTS)}")
  return args


def run_name(cfg: str, variant: str, lr: float) -> str:
  return f"{cfg}-{variant}-lr{lr:g}"


# --- Analysis -----------------------------------------------------------------------


def judge(run: dict, args) -> dict:
  """One run's outcome: diverged, locked in or stable, with the numbers behind it ("too
  high" compares runs, and is `mark_too_high`'s)."""
  records, summary, settings = run["records"], run["summary"], run["config"]
  step_S, loss_S = exp_common.column(records, "step"), exp_common.column(records, "loss")
  norm_S = exp_common.column(records, "grad_norm")
  smooth_S = exp_common.smooth(loss_S, SMOOTH_STEPS)
  nonfinite = np.flatnonzero(~np.isfinite(loss_S))
  rise = (float(smooth_S[-1] - np.nanmin(smooth_S))
          if len(smooth_S) and np.isfinite(smooth_S).any() else None)
  locked = exp_common.locked_in(summary, args.lock_in)
  if "diverged" in summary or len(nonfinite):
    outcome, why = "diverged", (f"NaN/inf loss from step {int(step_S[nonfinite[0]])}"
                                if len(nonfinite) else summary["diverged"])
  elif rise is not None and rise > args.blowup:
    outcome, why = "diverged", f"loss rose {rise:.2f} nats above its lowest"
  elif locked:
    rep = summary["repetition"]
    outcome, why = "locked in", (f"top_token_share {rep['top_token_share']:.2f}, "
                                 f"repeat_4 {rep['repeat_4']:.2f}")
  else:
    outcome, why = "stable", ""
  return {
      "config": settings["config"], "peak_lr": settings["peak_lr"],
      "warmup_steps": settings["warmup_steps"], "steps": len(loss_S),
      "planned_steps": settings["steps"], "outcome": outcome, "why": why,
      "initial_loss": float(loss_S[0]) if len(loss_S) else None,
      "final_loss": exp_common.final_loss(loss_S, max(10, len(loss_S) // 10)),
      "lowest_smoothed_loss": (float(np.nanmin(smooth_S))
                               if np.isfinite(smooth_S).any() else None),
      "largest_norm": float(np.nanmax(norm_S)) if np.isfinite(norm_S).any() else None,
      "median_norm": float(np.nanmedian(norm_S)) if np.isfinite(norm_S).any() else None,
      "repetition": summary.get("repetition", {}),
      "environment": run["environment"],
  }


def _by_pair(judged: dict) -> dict[tuple, list]:
  """{(config, variant): its runs' judgements, by ascending peak learning rate}."""
  by_pair: dict[tuple, list] = {}
  for j in sorted(judged.values(), key=lambda j: j["peak_lr"]):
    by_pair.setdefault((j["config"], j["variant"]), []).append(j)
  return by_pair


def mark_too_high(judged: dict, worse_by: float) -> None:
  """Calls "too high" every stable rate above its config and variant's best rate whose
  lowest smoothed loss is more than `worse_by` nats above the best's."""
  for runs in _by_pair(judged).values():
    runs = [j for j in runs if j["lowest_smoothed_loss"] is not None]
    if not runs:
      continue
    best = min(runs, key=lambda j: j["lowest_smoothed_loss"])
    for j in runs:
      gap = j["lowest_smoothed_loss"] - best["lowest_smoothed_loss"]
      if j["outcome"] == "stable" and j["peak_lr"] > best["peak_lr"] and gap > worse_by:
        j["outcome"], j["why"] = "too high", (f"lowest loss {gap:.2f} nats above "
                                              f"{best['peak_lr']:g}'s")


def stable_range(judged: dict) -> dict:
  """Per (config, variant): the largest stable rate, and the smallest failure above it."""
  ranges = {}
  for (cfg, variant), runs in sorted(_by_pair(judged).items()):
    stable = [j["peak_lr"] for j in runs if j["outcome"] == "stable"]
    largest = max(stable) if stable else None
    above = [j for j in runs if j["outcome"] != "stable"
             and (largest is None or j["peak_lr"] > largest)]
    ranges[f"{cfg} {variant}"] = {
        "tried": [j["peak_lr"] for j in runs], "largest_stable": largest,
        "first_failure_above": ({"peak_lr": above[0]["peak_lr"], "outcome": above[0]["outcome"]}
                                if above else None)}
  return ranges


def range_sentence(pair: str, r: dict) -> str:
  tried = ", ".join(f"{lr:g}" for lr in r["tried"])
  fail = r["first_failure_above"]
  if r["largest_stable"] is None:
    return f"{pair}: no rate tried ({tried}) was stable; the lowest {fail['outcome']}."
  if fail is None:
    return (f"{pair}: every rate tried ({tried}) was stable; the edge lies above "
            f"{r['largest_stable']:g}.")
  return (f"{pair}: stable up to {r['largest_stable']:g}; {fail['peak_lr']:g} "
          f"{fail['outcome']} (tried {tried}).")


# --- Report -------------------------------------------------------------------------


def write_report(env, judged: dict, ranges: dict, args) -> str:
  lines = ["# The stable peak learning rate, per recipe and size\n",
           f"Report: `{env['command']}` ({env['date']}). Runs:\n"]
  lines += exp_common.made_by({name: j["environment"] for name, j in judged.items()})
  lines += ["", f"Diverged: a NaN/inf loss, or a {SMOOTH_STEPS}-step moving-average loss "
            f"that ended more than {args.blowup:g} nats above its lowest. Locked in: the "
            f"samples' mean top_token_share or repeat_4 above {args.lock_in:g}. Too high: a "
            f"rate above the best one of its config and variant whose lowest moving-average "
            f"loss is more than {args.worse_by:g} nats above the best's.\n"]
  header = ["config", "variant", "peak lr", "warmup", "steps", "loss first -> last 10%",
            "lowest (smoothed)", "largest / median norm", "top_token_share", "repeat_4",
            "outcome"]
  rows = []
  for name, j in sorted(judged.items(), key=lambda kv: (kv[1]["config"], kv[1]["variant"],
                                                        kv[1]["peak_lr"])):
    rep = j["repetition"]
    rows.append([j["config"], j["variant"], f"{j['peak_lr']:g}", j["warmup_steps"],
                 f"{j['steps']}" + (f" of {j['planned_steps']}"
                                    if j["steps"] != j["planned_steps"] else ""),
                 f"{exp_common.fmt(j['initial_loss'], 4)} -> {exp_common.fmt(j['final_loss'], 4)}",
                 exp_common.fmt(j["lowest_smoothed_loss"], 4),
                 f"{exp_common.fmt(j['largest_norm'])} / {exp_common.fmt(j['median_norm'])}",
                 exp_common.fmt(rep.get("top_token_share"), 2),
                 exp_common.fmt(rep.get("repeat_4"), 2),
                 j["outcome"] + (f" ({j['why']})" if j["why"] else "")])
  lines += [exp_common.md_table(header, rows), "", "## Stable range\n"]
  lines += ["- " + range_sentence(pair, r) for pair, r in ranges.items()]
  lines += [""] + [f"![{cfg}]({cfg}-lr.png)\n" for cfg in sorted({j["config"]
                                                                  for j in judged.values()})]
  return "\n".join(lines) + "\n"


def plot_config(path: str, cfg: str, judged: dict) -> None:
  fig, ax = plt.subplots(figsize=(8, 5))
  markers = {"stable": "o", "too high": "^", "locked in": "s", "diverged": "x"}
  variants = sorted({j["variant"] for j in judged.values() if j["config"] == cfg})
  for variant, color in zip(variants, exp_v1_vs_v2.COLORS):
    runs = sorted((j for j in judged.values()
                   if j["config"] == cfg and j["variant"] == variant),
                  key=lambda j: j["peak_lr"])
    lrs = [j["peak_lr"] for j in runs]
    best = [j["lowest_smoothed_loss"] if j["lowest_smoothed_loss"] is not None else np.nan
            for j in runs]
    ax.plot(lrs, best, color=color, lw=1, label=variant)
    for lr, loss, j in zip(lrs, best, runs):
      if np.isfinite(loss):
        ax.scatter([lr], [loss], color=color, marker=markers[j["outcome"]], s=40, zorder=3)
  ax.set_xscale("log")
  ax.set_xlabel("peak learning rate (o stable, ^ too high, s locked in, x diverged)")
  ax.set_ylabel(f"lowest {SMOOTH_STEPS}-step mean loss")
  ax.set_title(f"{cfg}: learning-rate sweep, one seed")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  lrs = [float(x) for x in exp_common.split_list(args.lrs)]
  env = exp_common.environment("exp_lr_sweep.py", argv)
  if not args.report_only:
    for cfg in exp_common.split_list(args.configs):
      for variant in exp_common.split_list(args.variants):
        for lr in lrs:
          exp_common.run_training(exp_common.base_config(
              args, cfg, steps=args.steps, peak_lr=lr,
              out_dir=os.path.join(args.out_dir, run_name(cfg, variant, lr)),
              **exp_v1_vs_v2.VARIANTS[variant]), env)
  judged = {}
  for name in sorted(os.listdir(args.out_dir)) if os.path.isdir(args.out_dir) else []:
    match = RUN_NAME.match(name)
    run = exp_common.read_run(os.path.join(args.out_dir, name)) if match else None
    if run and match["variant"] in exp_v1_vs_v2.VARIANTS:
      judged[name] = {**judge(run, args), "variant": match["variant"]}
  mark_too_high(judged, args.worse_by)
  ranges = stable_range(judged)
  for cfg in sorted({j["config"] for j in judged.values()}):
    plot_config(os.path.join(args.out_dir, f"{cfg}-lr.png"), cfg, judged)
  results = {"environment": env, "definitions": {
      "smooth_steps": SMOOTH_STEPS, "blowup": args.blowup, "lock_in": args.lock_in,
      "worse_by": args.worse_by},
      "runs": judged, "stable_range": ranges}
  markdown = write_report(env, judged, ranges, args)
  exp_common.write_outputs(args.out_dir, results, markdown)
  print(markdown)
  return results


if __name__ == "__main__":
  exp_common.run_cli(main)
