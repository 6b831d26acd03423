"""The real training step held to its targets (docs/performance.md): each clip's step, and the
control, against its peer in the same rounds, on the paired ratio's median and its 95%
interval (`timing.median_interval`). examples/benchmark.py's rows are the input."""

from __future__ import annotations

import statistics

from benchlib import timing

# The targets a clip's step is held to (docs/performance.md): (what, clock, the variant it is
# paired with, the bound on the median of the rounds' ratios).
TARGETS = (("wall vs adamw alone", "wall", "none", 1.02),
           ("wall vs optax's chain", "wall", "optax", 1.0),
           ("host vs adamw alone", "host", "none", 1.05))


def paired_ratios(row, base, clock):
  """Each round's time of `row` on `clock` over `base`'s in the same round."""
  return [a / b for a, b in zip(row[f"{clock}_ms"]["rounds"], base[f"{clock}_ms"]["rounds"])]


def target_verdicts(rows):
  """Each clip's step in a case's rows against the targets (TARGETS), and the control
  against those on adamw alone: the median of the paired ratios, its 95% interval
  (`timing.median_interval`) and whether the interval is within the bound. The control,
  the same program as adamw alone, shows what the rounds can resolve."""
  by_variant = {r["variant"]: r for r in rows}
  out = []
  for row in rows:
    for target, clock, peer, bound in TARGETS:
      if peer not in by_variant or not (row["variant"].startswith("andrea") or (
          row["variant"] == "none_again" and peer == "none")):
        continue
      ratios = paired_ratios(row, by_variant[peer], clock)
      interval = timing.median_interval(ratios)
      out.append({**{k: row[k] for k in ("model", "batch", "dtype", "variant", "label")},
                  "target": target, "bound": bound, "median": statistics.median(ratios),
                  "interval": interval, "verdict": timing.verdict(interval, bound)})
  return out


def verdicts_text(verdicts):
  lines = ["targets (paired ratio, its 95% interval, the bound):"]
  for v in verdicts:
    interval = v["interval"]
    within = f" [{interval[0]:.3f}-{interval[1]:.3f}]" if interval else ""
    lines.append(f"{v['model']} B{v['batch']} {v['dtype']}, {v['label']}: {v['target']} "
                 f"{v['median']:.3f}{within} <= {v['bound']:g}: {v['verdict']}")
  return "\n".join(lines)
