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


class Log:
  """Progress lines with the seconds since the start."""

  def __init__(self):
    self.t0 = time.perf_counter()

  def elapsed(self):
    return time.perf_counter() - self.t0

  def __call__(self, msg):
    print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)
