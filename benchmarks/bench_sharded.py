"""Global-norm clipping of gradients sharded over every visible device: clipjax against
optax, the clip alone and inside the full training step.

One run builds GPT-shaped gradients, lays them out over a 1-D mesh ("data",) of every device,
checks each clip against a float64 reference, then times
  - the clip alone, K clips per jitted call, donated: clip_tree under jit (the drop-in,
    partitioned by XLA; with the custom call and pure JAX), sharded_clip_tree (explicit
    shard_map; the custom call and pure JAX), optax.clip_by_global_norm, and the custom call
    on one device holding the whole tree;
  - the FSDP training step, one per jitted call, params, optimizer state and gradients
    donated: optax.chain(andrea_clip(1.0), adamw(1e-4)) against
    optax.chain(clip_by_global_norm(1.0), adamw(1e-4)), with each device's busy time and
    the per-device peak memory of the compiled step.
It prints two tables and writes JSON.

    python benchmarks/bench_sharded.py                  # every visible GPU (at least 2)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python benchmarks/bench_sharded.py --quick      # tiny shapes on 2 CPU devices

docs/performance.md has what it measured; docs/development.md ("Timing") says how.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import clipjax
from benchlib import record, sharded, tables, timing, train_step
from benchlib.cli import Log, add_run_flags, choices
from benchlib.profiling import compile_summary
from benchlib.tables import num
from benchlib.timing import COPY_BYTES, REGIMES
from benchlib.trees import (AXIS, DTYPES, MODELS, Layout, counts_note, device_bytes, f32_norm,
                            f64_norm, gpt_grad_spec)

LAYOUTS = ("fsdp", "replicated")
DEFAULT_IMPLS = "plain,andrea,optax,single"
log = Log()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, choices=list(MODELS),
                 help="gradient shapes (default gpt120m; --quick: tiny)")
  p.add_argument("--layouts", default="fsdp", help="comma list of: " + ", ".join(LAYOUTS))
  p.add_argument("--dtypes", default="f32", help="comma list of: " + ", ".join(DTYPES))
  p.add_argument("--regimes", default="clip", help="comma list of: " + ", ".join(REGIMES))
  p.add_argument("--impls", default=None, help="comma list of: " + ", ".join(sharded.IMPLS)
                 + f" (default {DEFAULT_IMPLS}; --quick: all)")
  p.add_argument("--steps", default=",".join(train_step.CHAINS),
                 help="training-step chains to time, comma list of: "
                      + ", ".join(train_step.CHAINS) + " ('' for none)")
  p.add_argument("--andrea-impl", default=None, choices=("auto", "ffi"),
                 help="impl= of the custom-call rows (default: auto on a GPU, the CUDA "
                      "custom call; ffi elsewhere, the CPU handler, since auto is pure JAX "
                      "there)")
  p.add_argument("--reps", type=int, default=10, help="K, clips per jitted call (custom call)")
  p.add_argument("--optax-reps", type=int, default=4, help="K for optax and plain_jax")
  p.add_argument("--jax-reps", type=int, default=2, help="K for sharded_clip_tree(jax)")
  add_run_flags(p, "bench_sharded")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few repetitions: runs on CPU devices")
  args = p.parse_args(argv)
  if args.quick:
    args.model, args.impls = args.model or "tiny", args.impls or ",".join(sharded.IMPLS)
    args.reps, args.optax_reps, args.jax_reps = 3, 2, 2
    args.iters, args.repeats, args.max_seconds = 2, 2, 0
  args.model = args.model or "gpt120m"
  args.layouts = choices(p, "--layouts", args.layouts, LAYOUTS)
  args.dtypes = choices(p, "--dtypes", args.dtypes, DTYPES)
  args.regimes = choices(p, "--regimes", args.regimes, REGIMES)
  args.impls = choices(p, "--impls", args.impls or DEFAULT_IMPLS, sharded.IMPLS)
  args.steps = choices(p, "--steps", args.steps, train_step.CHAINS) if args.steps else []
  return args


def main(argv=None):
  args = parse_args(argv)
  n = jax.device_count()
  if n < 2:
    sys.exit(f"bench_sharded.py needs at least 2 devices; jax sees {n} "
             f"({jax.default_backend()}). On a CPU, start it with "
             "XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu.")
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  andrea_impl, andrea_note = pick_andrea_impl(args.andrea_impl, mesh)
  meta = record.run_metadata(args)
  first = jax.tree.leaves(gpt_grad_spec(args.model, args.dtypes[0]))
  meta.update(andrea_impl_arg=andrea_impl, andrea_impl_note=andrea_note or None,
              model=args.model, leaves=len(first), params=sum(math.prod(x.shape) for x in first),
              norm_rtol=sharded.NORM_RTOL, update_rtol_vs_float64=sharded.UPDATE_RTOL)
  if andrea_note:
    log(f"WARNING: {andrea_note}")
  log(f"{n} x {meta['device_kinds'][0]} ({meta['backend']}): jax {meta['jax']}, optax "
      f"{meta['optax']}, clipjax {meta['clipjax']}; custom-call rows impl=\"{andrea_impl}\"")
  log(f"{args.model}: {meta['params'] / 1e6:.2f}M params, {meta['leaves']} leaves"
      f"{counts_note(args.model, meta['params'], meta['leaves'])}")
  out = args.out or record.default_out_path("bench_sharded", meta)
  results = {"meta": meta, "checks": [], "rows": [], "steps": []}
  bw = timing.copy_bandwidth(COPY_BYTES if not args.quick else 1 << 24, 10, args.repeats)
  meta["copy_bandwidth_GBps"] = bw / 1e9
  log(f"copy bandwidth of one device (bytes read + written): {bw / 1e9:.0f} GB/s")

  names = args.layouts + (["single"] if "single" in args.impls else [])
  layouts = {(name, dtype): Layout(name, mesh, gpt_grad_spec(args.model, dtype))
             for dtype in args.dtypes for name in names}
  for dtype in args.dtypes:
    check_dtype(args, layouts, dtype, andrea_impl, results)
  meta["passed"] = all(c["ok"] for c in results["checks"])
  log(f"correctness: {'PASS' if meta['passed'] else 'FAIL'}")
  record.save_json(results, out, complete=False)
  meta["skipped"] = []
  time_clips(args, layouts, andrea_impl, bw, results, out)
  time_steps(args, layouts, results, out)
  time_clips(args, layouts, andrea_impl, bw, results, out, pure_jax=True)
  finish(results, args, out)


def check_dtype(args, layouts, dtype, andrea_impl, results):
  """Correctness before anything is timed: one clip per impl and layout on the same tree, and
  one step of each training chain."""
  ref_norm = f64_norm(layouts[args.layouts[0], dtype].tree(sharded.SEED))
  results["meta"].setdefault("reference_norm", {})[dtype] = ref_norm
  for name in args.layouts + (["single"] if "single" in args.impls else []):
    layout = layouts[name, dtype]
    impls = ["single"] if name == "single" else [i for i in sharded.SHARDED_IMPLS
                                                 if i in args.impls]
    log(f"{name} {dtype}: {layout.sharded_leaves()} of {results['meta']['leaves']} leaves "
        f"sharded, {device_bytes(layout.tree(sharded.SEED)) / 1e6:.1f} MB on the fullest device")
    results["checks"] += sharded.run_checks(layout, dtype, impls, ref_norm, andrea_impl, log)
  if args.steps:
    results["checks"] += train_step.check_chains(layouts["fsdp", dtype], dtype)
  for c in results["checks"]:
    if c["dtype"] == dtype:
      value = "" if c["value"] is None else f" {c['value']:.2e}" + (
          "" if c["tol"] is None else f" (tol {c['tol']:.0e})")
      log(f"  check {c['layout']:10s} {dtype:4s} {c['what']:44s}{value}  "
          f"{'ok' if c['ok'] else 'FAIL'}")


def over_time(args, results, what):
  if args.max_seconds and log.elapsed() > args.max_seconds:
    results["meta"]["skipped"].append(what)
    log(f"  over --max-seconds: skipping {what}")
    return True
  return False


def time_clips(args, layouts, andrea_impl, bw, results, out, pure_jax=False):
  """Times each (layout, dtype, regime, impl) of the clip alone; the pure-JAX rows, the
  slowest to compile, in a pass of their own after the training step."""
  K = {"plain": args.reps, "andrea": args.reps, "single": args.reps, "optax": args.optax_reps,
       "plain_jax": args.optax_reps, "jax": args.jax_reps}
  units = [(name, impl) for name in args.layouts for impl in sharded.SHARDED_IMPLS
           if impl in args.impls] + [("single", "single")] * ("single" in args.impls)
  units = [(name, impl) for name, impl in units if (impl in ("jax", "plain_jax")) == pure_jax]
  for dtype in args.dtypes:
    for regime in args.regimes:
      for name, impl in units:
        what = f"{name} {dtype} {regime} {sharded.LABELS[impl]}"
        if over_time(args, results, what):
          continue
        layout = layouts[name, dtype]
        norm0 = float(f32_norm(layout.tree(sharded.SEED)))
        fn = sharded.repeated_fn(sharded.clip_fn(impl, layout, andrea_impl), layout,
                                 f"clips_{impl}_{name}")
        example = layout.tree(sharded.SEED)
        hlo = compile_summary(fn, example, sharded.max_norms(layout, regime, 1.0, K[impl]))
        nbytes = device_bytes(example)
        del example
        r = sharded.time_clip(fn, layout, regime, norm0, K[impl], args)
        floor_us = (3 if regime == "clip" else 1) * nbytes / bw * 1e6
        results["rows"].append(dict(
            layout=name, dtype=dtype, regime=regime, impl=impl, label=sharded.LABELS[impl],
            device_bytes=nbytes, floor_us=floor_us, compile_s=hlo["compile_s"],
            sharded_leaves=layout.sharded_leaves(), hlo=hlo, **r))
        log(f"  {what:44s} in-jit {r['us_injit']:9.1f} us  device {num(r.get('us_device'), 9)}"
            f" us  floor {floor_us:8.1f} us  (K={K[impl]}, compile {hlo['compile_s']} s, "
            f"{tables.collectives_text(hlo)})"
            + ("" if r["regime_ok"] else "  WARNING: the regime did not hold"))
        sharded.add_ratios(results["rows"])
        record.save_json(results, out, complete=False)


def time_steps(args, layouts, results, out):
  """Times each training-step chain on the FSDP layout, one step per call."""
  for dtype in args.dtypes:
    for name in args.steps:
      what = f"fsdp {dtype} step {train_step.CHAINS[name]}"
      if over_time(args, results, what):
        continue
      r = train_step.bench(name, layouts["fsdp", dtype], args)
      results["steps"].append(dict(layout="fsdp", dtype=dtype, **r))
      peak = (r["memory"] or {}).get("peak_bytes")
      log(f"  {what:44s} in-jit {r['us_injit']:9.1f} us  device {num(r.get('us_device'), 9)}"
          f" us  peak {num(peak and peak / 1e6, 9)} MB/device  (compile {r['compile_s']} s)")
      train_step.add_ratios(results["steps"])
      record.save_json(results, out, complete=False)


def finish(results, args, out):
  meta = results["meta"]
  order = {impl: i for i, impl in enumerate(sharded.IMPLS)}
  layout_order = args.layouts + ["single"]
  results["rows"].sort(key=lambda r: (args.dtypes.index(r["dtype"]),
                                      args.regimes.index(r["regime"]),
                                      layout_order.index(r["layout"]), order[r["impl"]]))
  sharded.add_ratios(results["rows"])
  print("\n" + tables.sharded_clip_table(results["rows"], meta))
  if results["steps"]:
    print("\n" + tables.train_step_table(results["steps"], meta))
  if meta["skipped"]:
    print("skipped (over --max-seconds): " + "; ".join(meta["skipped"]))
  failed = [c for c in results["checks"] if not c["ok"]]
  print(f"\ncorrectness: {'PASS' if meta['passed'] else 'FAIL'} ({len(results['checks'])} "
        "checks" + (": failed " + "; ".join(f"{c['layout']} {c['dtype']} {c['what']} = "
                                            f"{c['value']}" for c in failed) if failed else "")
        + ")", flush=True)
  record.save_json(results, out, complete=True)
  log(f"wrote {out}")
  if not meta["passed"]:
    sys.exit(1)


def pick_andrea_impl(requested, mesh):
  """(impl, note): the impl= of the custom-call rows, and why, if not the default.

  The default is "auto" on a GPU (the CUDA custom call) and "ffi" elsewhere (the CPU
  handler; "auto" is pure JAX there). Unless --andrea-impl names one, each candidate must
  first compile sharded_clip_tree on a leaf split over the mesh; the first that does is used.
  """
  if requested:
    return requested, ""
  candidates = ["auto", "ffi"] if jax.default_backend() == "gpu" else ["ffi", "auto"]
  n = mesh.devices.size
  probe = jax.device_put(jnp.ones((2 * n, 4), jnp.float32), NamedSharding(mesh, P(AXIS)))
  failures = []
  for impl in candidates:
    try:
      jax.jit(lambda t, impl=impl: clipjax.sharded_clip_tree(
          t, 1.0, mesh=mesh, specs=P(AXIS), impl=impl).updates).lower(probe).compile()
    except Exception as e:  # noqa: BLE001 - reported on stdout and in the JSON
      failures.append(f'impl="{impl}" fails on a leaf sharded over {n} devices: '
                      f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")
      continue
    return impl, "; ".join(failures) + (f' -- using impl="{impl}" instead' if failures else "")
  return "jax", "; ".join(failures) + ' -- no custom call: the custom-call rows are impl="jax"'


if __name__ == "__main__":
  main()
