"""What the two experiment scripts share: training flags, runs, metrics arrays, report text.

exp_fallback_vs_cuda.py and exp_v1_vs_v2.py both train the example (loop.train)
several times with one setting changed, then write report.md, results.json and PNG plots
into their --out-dir. This file holds the flags that pass through to every run, the run
itself, and the small helpers that turn metrics records into arrays and tables.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import sys

import jax
import numpy as np

from gpt import config
from gpt.reports import metrics
from gpt.training import loop

# Settings passed through to every training run of an experiment; None keeps the preset.
TRAIN_FLAGS = {
    "batch_size": int, "context_length": int, "peak_lr": float, "warmup_steps": int,
    "vocab_size": int, "max_source_mb": float, "num_samples": int, "sample_tokens": int,
    "dtype": str, "cache_dir": str, "time_limit_s": float,
}
# Switches passed through to every training run.
TRAIN_SWITCHES = {
    "overwrite": "replace the earlier runs in --out-dir",
    "resume": "continue runs cut short by --time-limit-s from their last checkpoint; "
              "finished and diverged runs are kept as they are",
}


def add_train_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--seed", type=int, default=0,
                      help="one seed for every run: same init, phases and batches")
  for field, kind in TRAIN_FLAGS.items():
    parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None,
                        help="passed to every run (default: the config's preset)")
  parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH_OR_GLOB",
                      help="as in train_gpt.py; repeatable")
  for field, help_text in TRAIN_SWITCHES.items():
    parser.add_argument(f"--{field}", action="store_true", help=help_text)
  parser.add_argument("--no-progress", dest="progress", action="store_false")


def add_report_flags(parser: argparse.ArgumentParser, out_dir: str) -> None:
  """--out-dir, --report-only and --lock-in: where runs go, and how their report judges."""
  parser.add_argument("--lock-in", type=float, default=0.5,
                      help="lock-in: mean top_token_share or repeat_4 of the samples above this")
  parser.add_argument("--out-dir", default=out_dir)
  parser.add_argument("--report-only", action="store_true",
                      help="no training: report the runs already in --out-dir")


def split_list(text: str) -> list[str]:
  return [item for item in text.split(",") if item]


def base_config(args: argparse.Namespace, config_name: str, **settings) -> config.TrainConfig:
  """The TrainConfig of one run: the pass-through flags, then this run's own settings."""
  passed = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None}
  switches = {k: getattr(args, k) for k in TRAIN_SWITCHES}
  return config.TrainConfig(
      config=config_name, seed=args.seed, sources=tuple(args.source),
      progress=args.progress, **{**passed, **switches, **settings})


def run_training(cfg: config.TrainConfig, env: dict) -> list[dict]:
  """Trains one run and notes what made it.

  A run that diverges (loop.TrainingDiverged) is an outcome, not an error: its summary.json
  records why. Checkpoints are removed once a run has ended, and kept when --time-limit-s
  cut it short, so that --resume can continue it.
  """
  run_dir = config.resolve(cfg).out_dir
  if cfg.resume and run_state(run_dir) in ("finished", "diverged"):
    return metrics.read_records(os.path.join(run_dir, "metrics.jsonl"))
  if cfg.resume and not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    # Killed before its only checkpoint (at the end): nothing to continue, so it starts again.
    cfg = dataclasses.replace(cfg, resume=False, overwrite=True)
  cfg = dataclasses.replace(cfg, checkpoint_every=cfg.steps or 10**9)
  try:
    records = loop.train(cfg)
  except loop.TrainingDiverged as e:
    records = metrics.read_records(os.path.join(run_dir, "metrics.jsonl"))
    metrics.write_json_atomic(os.path.join(run_dir, "summary.json"), {"diverged": str(e)})
  if run_state(run_dir) != "cut short":
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
  with open(os.path.join(run_dir, "environment.json"), "w") as f:
    json.dump(env, f, indent=2)
  return records


def run_state(run_dir: str) -> str | None:
  """"finished", "diverged", "cut short" (by --time-limit-s) or None (no summary yet)."""
  path = os.path.join(run_dir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  if "diverged" in summary:
    return "diverged"
  return "cut short" if summary.get("stopped_by_time_limit") else "finished"


def locked_in(summary: dict, threshold: float) -> bool | None:
  """Repetition lock-in: the samples' mean top_token_share or repeat_4 above threshold
  (None for a run without samples)."""
  rep = summary.get("repetition")
  if not rep:
    return None
  return max(rep["top_token_share"], rep["repeat_4"]) > threshold


def final_loss(loss_S: np.ndarray, last: int = 10) -> float | None:
  """The mean of the last `last` finite losses."""
  finite = loss_S[np.isfinite(loss_S)]
  return float(np.mean(finite[-last:])) if len(finite) else None


def read_run(run_dir: str) -> dict | None:
  """The records, settings, summary and environment a finished run left, or None."""
  names = ("metrics.jsonl", config.CONFIG_FILE, "summary.json", "environment.json")
  paths = {name: os.path.join(run_dir, name) for name in names}
  if not all(os.path.exists(p) for p in paths.values()):
    return None
  run = {"records": metrics.read_records(paths["metrics.jsonl"])}
  for key, name in (("config", config.CONFIG_FILE), ("summary", "summary.json"),
                    ("environment", "environment.json")):
    with open(paths[name]) as f:
      run[key] = json.load(f)
  return run


def column(records: list[dict], key: str) -> np.ndarray:
  """One float per step record (NaN stays NaN; booleans become 0/1)."""
  return np.array([float(r[key]) for r in metrics.step_records(records)], dtype=np.float64)


def boundaries(records: list[dict]) -> list[int]:
  """The first step of every phase after the first: where the source weights change."""
  return [r["step"] for r in records if r["kind"] == "phase" and r["phase"] > 0]


def smooth(values: np.ndarray, width: int) -> np.ndarray:
  """Trailing moving average over finite values (NaN where a window has none)."""
  finite = np.isfinite(values)
  sums = np.cumsum(np.where(finite, values, 0.0))
  counts = np.cumsum(finite)
  lo = np.maximum(np.arange(len(values)) - width, -1)
  window_sums = sums - np.where(lo >= 0, sums[np.maximum(lo, 0)], 0.0)
  window_counts = counts - np.where(lo >= 0, counts[np.maximum(lo, 0)], 0)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(window_counts > 0, window_sums / window_counts, np.nan)


def command(script: str, argv: list[str] | None) -> str:
  """The command line that ran `script` with `argv` (default: this process's arguments)."""
  args = sys.argv[1:] if argv is None else argv
  return shlex.join(["python", f"examples/experiments/{script}", *args])


def environment(script: str, argv: list[str] | None) -> dict:
  """What made the results: the command, versions and the device."""
  device = jax.devices()[0]
  return {
      "command": command(script, argv),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "jax": jax.__version__, "platform": device.platform,
      "device": getattr(device, "device_kind", str(device)), "python": platform.python_version(),
  }


def made_by(environments: dict) -> list[str]:
  """Report lines naming the command, device and date that made each run, runs made by one
  command together. `environments`: {run name: its environment.json}."""
  groups: dict[tuple, list[str]] = {}
  for name, e in environments.items():
    groups.setdefault((e["command"], e["device"], e["platform"], e["jax"], e["date"]),
                      []).append(name)
  return [f"- {', '.join(names)}: `{command}` on {device} ({platform}), jax {jax_version}, "
          f"{date}" for (command, device, platform, jax_version, date), names in groups.items()]


def md_table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
  return "\n".join(lines)


def fmt(x, digits: int = 3) -> str:
  """A number for a table: 3 significant digits, 'n/a' for None, 'nan' kept visible."""
  if x is None:
    return "n/a"
  if isinstance(x, (bool, np.bool_)):
    return "yes" if x else "no"
  if isinstance(x, (int, np.integer)):
    return str(int(x))
  return f"{x:.{digits}g}"


def run_cli(main) -> None:
  """Runs an experiment's main; a bad flag, source or run directory is one error line."""
  try:
    main()
  except loop.USER_ERRORS as e:
    sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")


def write_outputs(out_dir: str, results: dict, markdown: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2, default=_json_default)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown)


def _json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON serializable: {type(x)}")
