"""Compile time and peak memory of a jitted clip as the leaf count grows.

Each case runs in a subprocess of its own, so that its peak resident memory is its own:
it builds a tree of N float32 leaves of 1 to 2,000 elements (seeded), then lowers and
compiles `jax.jit(tx.update)` for andrea_clip (the custom call, and pure JAX) and for
optax.clip_by_global_norm; and, as the floor that any clip of N leaves stands on, a jitted
function that takes the same leaves (donated) and hands them back unchanged. A case that
runs past --timeout-s is reported as such. It prints one table and writes JSON.

`--without-result-names` is a diagnostic: it lowers without the `jax.result_info` name
JAX gives every output. XLA's StableHLO-to-HLO conversion rewrites the whole list of
result attributes once per result, and the MLIR context keeps every list, so an update
with n outputs holds O(n^2) attributes: about 3 GB at 20,000 leaves, before any clip.
The flag shows what compiling costs without that, for the clip and for the floor alike.

    python benchmarks/bench_compile.py --leaves 1000,5000,20000
    python benchmarks/bench_compile.py --quick     # 50 leaves: a few seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

IMPLS = ("ffi", "jax", "optax", "floor")


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
  if impl == "floor":
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    fn, args = jax.jit(lambda t: t, donate_argnums=0), (tree,)
  else:
    tx = (optax.clip_by_global_norm(1.0) if impl == "optax"
          else clipjax.andrea_clip(1.0, impl=impl))
    fn, args = jax.jit(tx.update), (tree, tx.init(tree))
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--leaves", default="1000,5000,20000", help="comma list of leaf counts")
  p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
  p.add_argument("--timeout-s", type=float, default=600, help="per case")
  p.add_argument("--out", default=None,
                 help="JSON path (default benchmarks/results/bench_compile-<date>-<device>.json)")
  p.add_argument("--quick", action="store_true", help="50 leaves, each case at most 120 s")
  p.add_argument("--without-result-names", dest="result_names", action="store_false",
                 help="diagnostic: lower without JAX's per-output names (see above)")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    leaves, impl, result_names = args.child.split(":")
    print(json.dumps(compile_once(int(leaves), impl, bool(int(result_names)))))
    return
  if args.quick:
    args.leaves, args.timeout_s = "50", 120
  impls = args.impls.split(",")
  for impl in impls:
    if impl not in IMPLS:
      p.error(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
  rows = [run_case(int(n), impl, args.timeout_s, args.result_names)
          for n in args.leaves.split(",") for impl in impls]

  from benchlib import tables  # noqa: PLC0415 - imports jax, which the children must not share
  print(tables.render(
      "COMPILE TIME of one jitted update, and the compiling process's peak resident memory",
      [("leaves", 7, lambda r: (r["leaves"], 0)), ("impl", -6, lambda r: r["impl"]),
       ("compile s", 10, lambda r: r["compile_s"]),
       ("peak RSS GB", 12, lambda r: (r["peak_rss_gb"], 2)),
       ("status", -20, lambda r: r["status"])],
      rows, "impl: ffi andrea_clip (the custom call), jax andrea_clip(impl=\"jax\"), optax "
            "optax.clip_by_global_norm, floor the leaves handed back unchanged (donated); "
            "float32 leaves of 1-2,000 elements; compile s: lowering and compiling"
            + ("." if args.result_names else "; lowered WITHOUT per-output names.")))
  results = {"meta": tables.run_metadata(args), "rows": rows}
  out = args.out or tables.default_out_path("bench_compile", results["meta"])
  tables.save_json(results, out, complete=True)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
