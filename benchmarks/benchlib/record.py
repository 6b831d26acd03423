"""The JSON record every benchmark writes: the run's metadata (date, command, git commit,
devices, versions, settings) and its numbers, in one file. The docs' tables are made from
these records."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata as md

import jax
import numpy as np
import optax

import clipjax

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(REPOSITORY, "benchmarks", "results")


def run_metadata(args, command=None):
  """What every record holds: date, command line (`command`, else this process's), the
  git commit of the checkout, devices, versions, XLA_FLAGS and every setting."""
  devs = jax.devices()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": command or shlex.join(["python"] + sys.argv),
      "git_commit": git_commit(),
      "backend": jax.default_backend(), "platform": devs[0].platform,
      "device_count": len(devs),
      "device_kinds": sorted({getattr(d, "device_kind", str(d)) for d in devs}),
      "jax": jax.__version__, "jaxlib": package_version("jaxlib"), "optax": optax.__version__,
      "clipjax": clipjax.__version__, "clipjax_ffi_platforms": list(clipjax.ffi_platforms()),
      "python": platform.python_version(), "machine": platform.machine(),
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "settings": {k: v for k, v in vars(args).items() if k != "out"},
  }


def git_commit():
  """The checkout's commit, with "+changes" where tracked files differ from it; None
  outside a git checkout."""
  def git(*argv):
    return subprocess.run(["git", *argv], cwd=REPOSITORY, capture_output=True, text=True,
                          check=True).stdout.strip()

  try:
    commit = git("rev-parse", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
  except (OSError, subprocess.CalledProcessError):
    return None


def package_version(name):
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return None


def default_out_path(script, meta):
  """benchmarks/results/<script>-<date>-<device kind>[-xN].json (the folder is not tracked)."""
  kind = re.sub(r"[^a-z0-9]+", "-", meta["device_kinds"][0].lower()).strip("-")
  count = f"-x{meta['device_count']}" if meta["device_count"] > 1 else ""
  return os.path.join(RESULTS_DIR, f"{script}-{meta['date'][:10]}-{kind}{count}.json")


def save_rows(script, args, rows, **extra):
  """Writes a finished run's results ({"meta", "rows", **extra}) to --out or the default
  path of `script`, and says where."""
  results = {"meta": run_metadata(args), "rows": rows, **extra}
  out = args.out or default_out_path(script, results["meta"])
  save_json(results, out, complete=True)
  print(f"wrote {out}")
  return out


def save_json(results, path, complete):
  """Writes the results; `complete` false while a run is still going, so that a run stopped
  from outside leaves what it measured."""
  results["meta"]["complete"] = complete
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=_plain)


def _plain(x):
  """NumPy's scalars and arrays as JSON's numbers and lists."""
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  raise TypeError(f"not JSON serializable: {type(x)}")
