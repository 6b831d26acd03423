"""The entry points' command lines: comma-list options, and progress lines."""

from __future__ import annotations

import time


def choices(parser, flag, value, allowed):
  """The comma list `value` of option `flag`, each item one of `allowed`."""
  items = [s.strip() for s in value.split(",") if s.strip()]
  bad = [s for s in items if s not in allowed]
  if bad or not items:
    parser.error(f"{flag}: {', '.join(bad) or 'nothing'}; choose from {', '.join(allowed)}")
  return items


def add_run_flags(parser, script, *, iters=10, max_seconds=300):
  """The flags every timing script shares: rounds, the time budget, profiling, the JSON."""
  parser.add_argument("--iters", type=int, default=iters, help="jitted calls per timed round")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed rounds; the median is reported")
  parser.add_argument("--max-seconds", type=float, default=max_seconds,
                      help="start no new case after this many seconds (0: no limit)")
  parser.add_argument("--no-profile", action="store_true", help="skip the device-time rounds")
  parser.add_argument("--out", default=None,
                      help=f"JSON path (default benchmarks/results/{script}-<date>-<device>.json)")


class Log:
  """Progress lines with the seconds since the start."""

  def __init__(self):
    self.t0 = time.perf_counter()

  def elapsed(self):
    return time.perf_counter() - self.t0

  def __call__(self, msg):
    print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)
