"""Compile time and peak memory of a jitted clip as the leaf count grows.

Each case runs in a subprocess of its own, so that its peak resident memory is its own:
it builds a tree of N float32 leaves of 1 to 2,000 elements (seeded), then lowers and
compiles `jax.jit(tx.update, donate_argnums=0)` for andrea_clip (the custom call, and pure
JAX) and for optax.clip_by_global_norm, the gradients donated as a training step's are
its own intermediates; and, as the floor that any clip of N leaves stands on, a jitted
function that takes the same leaves (donated) and hands them back unchanged. A case that
runs past --timeout-s is reported as such. With --rounds R every case runs R times, the
cases taking turns (each round in the reverse order of the one before), so that a machine
whose speed drifts slows each case alike; a ratio below is then the median of the rounds'
ratios, each between two runs of one round, with its range. It prints the cases, then the
goals:

  custom call  at most 1.6x the floor's compile time and 1.25x its peak memory (the most
               leaves run)
  pure JAX     no slower to compile than optax's clip (at every leaf count both ran)

and writes JSON. The pure-JAX path and optax compile XLA:CPU kernels per leaf and run for
minutes at 5,000 leaves: above --pure-max-leaves they are not run.

`--without-result-names` is a diagnostic: it lowers without the `jax.result_info` name
JAX gives every output. XLA's StableHLO-to-HLO conversion rewrites the whole list of
result attributes once per result, and the MLIR context keeps every list, so an update
with n outputs holds O(n^2) attributes: about 3 GB at 20,000 leaves, before any clip.
The flag shows what compiling costs without that, for the clip and for the floor alike.

    python benchmarks/bench_compile.py                    # 2,000 and 20,000 leaves
    python benchmarks/bench_compile.py --leaves 20000 --impls floor,ffi --rounds 3
    python benchmarks/bench_compile.py --quick     # 10 leaves: a few seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings

IMPLS = ("ffi", "jax", "optax", "floor")
PURE = ("jax", "optax")  # the paths that compile kernels per leaf
GOALS = {"time": 1.6, "memory": 1.25}  # the custom call's, as multiples of the floor's


def drop_result_names() -> None:
  """Lowers every jitted function without per-result names (the diagnostic above)."""
  import inspect  # noqa: PLC0415

  from jax._src.interpreters import mlir  # noqa: PLC0415

  lower = mlir.lower_jaxpr_to_fun
  if "result_names" not in inspect.signature(lower).parameters:
    raise SystemExit("--without-result-names: this jax's lowering takes no result_names; "
                     "the diagnostic does not apply to it")

  def without_names(*args, **kwargs):
    kwargs["result_names"] = None
    return lower(*args, **kwargs)

  mlir.lower_jaxpr_to_fun = without_names


def compile_once(leaves: int, impl: str, result_names: bool) -> dict:
  """Runs in the child: one compile, timed."""
  import jax  # noqa: PLC0415 - the parent never imports jax
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import clipjax  # noqa: PLC0415

  if not result_names:
    drop_result_names()

  # Leaves put on the device from NumPy: `jnp.ones` of each size would compile a program per
  # distinct shape, and those programs' memory would count as the clip's.
  sizes = np.random.default_rng(0).integers(1, 2000, leaves)
  tree = [jax.device_put(np.ones((int(s),), np.float32)) for s in sizes]
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  if impl == "floor":
    fn, args = jax.jit(lambda t: t, donate_argnums=0), (tree,)
  else:
    tx = (optax.clip_by_global_norm(1.0) if impl == "optax"
          else clipjax.andrea_clip(1.0, impl=impl))
    fn, args = jax.jit(tx.update, donate_argnums=0), (tree, tx.init(tree))
  start = time.perf_counter()
  fn.lower(*args).compile()
  seconds = time.perf_counter() - start
  peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
  return {"leaves": leaves, "impl": impl, "compile_s": seconds, "peak_rss_gb": peak_gb,
          "result_names": result_names, "jax": jax.__version__,
          "backend": jax.default_backend()}


def run_case(leaves: int, impl: str, timeout_s: float, result_names: bool) -> dict:
  cmd = [sys.executable, __file__, "--child", f"{leaves}:{impl}:{int(result_names)}"]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return {"leaves": leaves, "impl": impl, "compile_s": None, "peak_rss_gb": None,
            "status": f"over {timeout_s:g} s"}
  if done.returncode != 0:
    return {"leaves": leaves, "impl": impl, "compile_s": None, "peak_rss_gb": None,
            "status": "failed: " + done.stderr.strip().splitlines()[-1][:200]}
  return {**json.loads(done.stdout.strip().splitlines()[-1]), "status": "ok"}


def goals(rows) -> list[dict]:
  """The custom call against the floor at the most leaves both ran; pure JAX against
  optax wherever both ran. Each ratio is the median over the rounds in which both ran
  (`ratios` has every round's)."""
  ok = {(r["leaves"], r["impl"], r["round"]): r for r in rows if r["status"] == "ok"}

  def check(n, impl, base, key, what, goal):
    ratios = [ok[(n, impl, k)][key] / ok[(n, base, k)][key] for (m, i, k) in sorted(ok)
              if (m, i) == (n, impl) and (n, base, k) in ok]
    ratio = statistics.median(ratios)
    return {"leaves": n, "what": what, "ratio": ratio, "ratios": ratios, "goal": goal,
            "met": ratio <= goal}

  def paired(impl, base):
    return sorted({n for n, i, k in ok if i == impl and (n, base, k) in ok})

  out = []
  clipped = paired("ffi", "floor")
  if clipped:
    n = max(clipped)
    for what, key in (("time", "compile_s"), ("memory", "peak_rss_gb")):
      out.append(check(n, "ffi", "floor", key, f"custom call / floor, {what}", GOALS[what]))
  for n in paired("jax", "optax"):
    out.append(check(n, "jax", "optax", "compile_s", "pure JAX / optax, time", 1.0))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--leaves", default="2000,20000", help="comma list of leaf counts")
  p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
  p.add_argument("--pure-max-leaves", type=int, default=5000,
                 help="the most leaves the jax and optax cases run at")
  p.add_argument("--timeout-s", type=float, default=900, help="per case")
  p.add_argument("--rounds", type=int, default=1,
                 help="runs of every case, the cases taking turns (see above)")
  p.add_argument("--out", default=None,
                 help="JSON path (default benchmarks/results/bench_compile-<date>-<device>.json)")
  p.add_argument("--quick", action="store_true", help="10 leaves, each case at most 120 s")
  p.add_argument("--without-result-names", dest="result_names", action="store_false",
                 help="diagnostic: lower without JAX's per-output names (see above)")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    leaves, impl, result_names = args.child.split(":")
    print(json.dumps(compile_once(int(leaves), impl, bool(int(result_names)))))
    return
  if args.quick:
    args.leaves, args.timeout_s = "10", 120
  impls = args.impls.split(",")
  for impl in impls:
    if impl not in IMPLS:
      p.error(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
  if args.rounds < 1:
    p.error(f"--rounds must be at least 1, got {args.rounds}")
  cases = [(n, impl) for n in map(int, args.leaves.split(",")) for impl in impls
           if not (impl in PURE and n > args.pure_max_leaves)]
  rows = []
  for k in range(args.rounds):
    for n, impl in cases if k % 2 == 0 else cases[::-1]:
      rows.append({**run_case(n, impl, args.timeout_s, args.result_names), "round": k})
      print(f"round {k}, {n} leaves, {impl}: {rows[-1]['status']}, "
            f"{rows[-1]['compile_s']} s, {rows[-1]['peak_rss_gb']} GB", flush=True)

  # benchlib imports jax, which the children must not share
  from benchlib import record, tables  # noqa: PLC0415
  print(tables.render(
      "COMPILE TIME of one jitted update, and the compiling process's peak resident memory",
      [("round", 5, lambda r: (r["round"], 0)), ("leaves", 7, lambda r: (r["leaves"], 0)),
       ("impl", -6, lambda r: r["impl"]), ("compile s", 10, lambda r: r["compile_s"]),
       ("peak RSS GB", 12, lambda r: (r["peak_rss_gb"], 2)),
       ("status", -20, lambda r: r["status"])],
      rows, "impl: ffi andrea_clip (the custom call), jax andrea_clip(impl=\"jax\"), optax "
            "optax.clip_by_global_norm, floor the leaves handed back unchanged; gradients "
            "donated; float32 leaves of 1-2,000 elements; compile s: lowering and compiling"
            + ("." if args.result_names else "; lowered WITHOUT per-output names.")))
  checks = goals(rows)
  print(tables.render(
      "GOALS", [("leaves", 7, lambda r: (r["leaves"], 0)), ("what", -32, lambda r: r["what"]),
                ("ratio", 6, lambda r: (r["ratio"], 2)),
                ("rounds", -16, lambda r: " ".join(f"{x:.2f}" for x in r["ratios"])),
                ("goal", 6, lambda r: (r["goal"], 2)),
                ("met", -4, lambda r: "yes" if r["met"] else "NO")],
      checks, "ratio: of compile times or of peak resident memory, the median over the "
              "rounds (each round's in `rounds`)"))
  record.save_rows("bench_compile", args, rows, goals=checks)


if __name__ == "__main__":
  main()
