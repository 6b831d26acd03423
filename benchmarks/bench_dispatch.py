"""The host's time inside one jitted call, by the arrays the call passes: what a
transformation's state costs a training step whose host sets the pace.

The call is a donated step over --arrays float32 arrays (a training step's parameters and
optimizer state) that scales each, plus a state of one of these layouts, each array of which
the step rewrites:

  - none: no state;
  - one scalar;
  - andrea_clip's state (`andrea_clip(1.0).init` on --leaves leaves: nine arrays, eight
    scalars and the leaf norms);
  - the same fields packed into two arrays (float32[3 + leaves], int32[5]);
  - 30 scalars.

Each round calls every layout --calls times, each call made once the one before it has
finished (so no wait for the GPU is in it), the order rotating from round to round; a
round gives the median call. The table gives the median over rounds with the spread
(lowest-highest round), the median of the rounds' ratios to "none" ("paired"), and what
each added array cost the host.

    python benchmarks/bench_dispatch.py             # on a GPU
    python benchmarks/bench_dispatch.py --quick     # few arrays and rounds: a CPU run
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

import clipjax
from benchlib import record, tables, timing

_F32, _I32, _BOOL = jnp.float32, jnp.int32, jnp.bool_  # the state's dtypes


def layouts(leaves):
  """{name: [(shape, dtype) of each state array]}."""
  clip = clipjax.andrea_clip(1.0).init([jnp.zeros((1,), _F32)] * leaves)
  return {
      "none": [],
      "one scalar": [((), _F32)],
      "andrea_clip's state": [(x.shape, x.dtype) for x in jax.tree.leaves(clip)],
      "its fields in two arrays": [((3 + leaves,), _F32), ((5,), _I32)],
      "30 scalars": [((), _F32)] * 30,
  }


def _rewrite(s):
  return ~s if s.dtype == _BOOL else s + jnp.ones((), s.dtype)


class Caller:
  """One layout's donated step and its arrays, carried from call to call."""

  def __init__(self, arrays, elements, state_arrays):
    step = jax.jit(lambda xs, st: ([x * 0.999 for x in xs], [_rewrite(s) for s in st]),
                   donate_argnums=(0, 1))
    self.args = ([jnp.full((elements,), 1.0 + i % 7, _F32) for i in range(arrays)],
                 [jnp.zeros(shape, dtype) for shape, dtype in state_arrays])
    self.step, self.state_arrays = step, len(state_arrays)
    self.run(3)  # compile, then the first calls after it

  def run(self, calls):
    """[seconds inside each call], each made with the device idle (`timing.timed_steps`)."""
    def step():
      self.args = self.step(*self.args)

    return timing.timed_steps(lambda: jax.block_until_ready(self.args), step, calls,
                              drained=True)[1]


def measure(callers, rounds, calls):
  """{layout: [median us of each round]} (`timing.interleaved_rounds`)."""
  return timing.interleaved_rounds(
      callers, rounds, lambda name: statistics.median(callers[name].run(calls)) * 1e6)


def rows_of(callers, per_round):
  base = per_round["none"]
  rows = []
  for name, us in per_round.items():
    paired = statistics.median(a / b for a, b in zip(us, base))
    extra = callers[name].state_arrays
    rows.append({"layout": name, "state_arrays": extra,
                 "host_us": timing.spread(us),
                 "paired_vs_none": paired,
                 "us_per_added_array": ((paired - 1) * statistics.median(base) / extra
                                        if extra else None)})
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--arrays", type=int, default=600,
                 help="donated float32 arrays besides the state (a step's params and moments)")
  p.add_argument("--elements", type=int, default=16384, help="elements of each of them")
  p.add_argument("--leaves", type=int, default=197, help="leaves of the clipped tree")
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--calls", type=int, default=20, help="calls per layout per round")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
  p.add_argument("--quick", action="store_true", help="few arrays and rounds: a CPU run")
  args = p.parse_args(argv)
  if args.quick:
    args.arrays, args.elements, args.leaves, args.rounds, args.calls = 40, 256, 10, 3, 3
  if min(args.arrays, args.elements, args.leaves, args.rounds, args.calls) < 1:
    p.error("every count must be at least 1")
  callers = {name: Caller(args.arrays, args.elements, state)
             for name, state in layouts(args.leaves).items()}
  rows = rows_of(callers, measure(callers, args.rounds, args.calls))
  print(tables.render(
      f"HOST TIME PER JITTED CALL, us: {args.arrays} donated f32[{args.elements}] arrays and a "
      f"state, on {jax.devices()[0].device_kind}",
      [("state", -34, lambda r: r["layout"]), ("arrays", 6, lambda r: (r["state_arrays"], 0)),
       ("host us", 8, lambda r: r["host_us"]["median"]),
       ("spread", 17, lambda r: f"{r['host_us']['min']:.1f}-{r['host_us']['max']:.1f}"),
       ("paired", 7, lambda r: (r["paired_vs_none"], 3)),
       ("us per array", 12, lambda r: r["us_per_added_array"])],
      rows, f"host: the median of a round's {args.calls} calls, each made with the device "
            f"idle; medians over {args.rounds} interleaved rounds, (lowest-highest round); "
            "paired: the median of the rounds' ratios to no state; us per array: what each "
            "state array added, from the paired ratio."))
  record.save_rows("bench_dispatch", args, rows)


if __name__ == "__main__":
  main()
