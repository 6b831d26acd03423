"""The full training step on one device: what the clip costs once it is chained ahead of an
optimizer, against the memory floor, optax's clip and torch.

Of the three training-step benchmarks this one alone takes the model out: the gradients
are its inputs, shaped like the GPT's (benchlib.trees), so that it reads the optimizer's
step on the GPU's busy time against the bytes it must move, for several optimizers.
examples/benchmark.py times the example's whole step (forward and backward included) on
the clocks a user reads; examples/experiments/bench_speed.py the example's training loop
against that step, and the model's variants.

For each model, dtype and regime (every step clips, or none does), one jitted step per call,
params, optimizer state and gradients donated, the gradients fresh for every step and
materialized inside it (as a backward pass would leave them), times
  - the optimizer alone;
  - optax.chain(clipjax.andrea_clip(max_norm), opt): scale="auto", which is "fused" there
    (the custom call computes the norm, XLA fuses the multiply into the optimizer's pass);
  - the same with scale="kernel" (k_grad_scale writes the clipped gradients first);
  - with --clips andrea_jax, the same with impl="jax" (the pure-JAX path: here, behind the
    barrier, its sums have no producer of the gradients to fuse into);
  - optax.chain(optax.clip_by_global_norm(max_norm), opt);
  - with adamw: torch's fused AdamW, alone and after clip_grad_norm_(foreach=True), captured
    in a CUDA graph with the same gradient pass.
Times are the GPU's busy time per step from the profiler (torch: CUDA events around graph
replays), so the host's dispatch of a call of hundreds of donated arrays is not measured.
Each step is read against its memory floor, and the clip's cost (the step minus the
optimizer alone) against N, one read of the gradients.

    python benchmarks/bench_step.py            # the GPU run
    python benchmarks/bench_step.py --quick    # tiny shapes: runs on a CPU in seconds

docs/performance.md has what it measured; docs/development.md ("Timing") says how.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchlib import record, tables, timing, torch_baseline, train_step  # noqa: E402
from benchlib.cli import Log, add_run_flags, choices  # noqa: E402
from benchlib.tables import num  # noqa: E402
from benchlib.timing import COPY_BYTES, REGIMES  # noqa: E402
from benchlib.trees import AXIS, DTYPES, MODELS, Layout, gpt_grad_spec  # noqa: E402

MAX_NORM = {"clip": 1.0, "noclip": 1e12}  # the gradients' norm is about 1e3-1e4
# Bytes per step at the floor, in units of N (the gradients' bytes): AdamW's 7N (read g, m,
# v, p; write m, v, p), one read for the norm, and the 2N of the pass that materializes the
# gradients inside the step, which every row pays.
FLOOR_N = 10
log = Log()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="gpt120m,gpt12m", help="comma list of: " + ", ".join(MODELS))
  p.add_argument("--dtypes", default="f32,bf16", help="comma list of: " + ", ".join(DTYPES))
  p.add_argument("--regimes", default="clip,noclip", help="comma list of: " + ", ".join(REGIMES))
  p.add_argument("--optimizers", default="adamw",
                 help="comma list of: " + ", ".join(train_step.OPTIMIZERS))
  p.add_argument("--clips", default="none,andrea,andrea_kernel,optax",
                 help="comma list of: " + ", ".join(train_step.CLIPS))
  p.add_argument("--no-torch", action="store_true", help="skip torch's steps")
  p.add_argument("--no-checks", action="store_true",
                 help="skip the correctness checks (a second run over cases already checked)")
  add_run_flags(p, "bench_step", max_seconds=0)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: a CPU run")
  args = p.parse_args(argv)
  if args.quick:
    args.models, args.iters, args.repeats, args.no_torch = "tiny", 2, 1, True
  args.models = choices(p, "--models", args.models, MODELS)
  args.dtypes = choices(p, "--dtypes", args.dtypes, DTYPES)
  args.regimes = choices(p, "--regimes", args.regimes, REGIMES)
  args.optimizers = choices(p, "--optimizers", args.optimizers, train_step.OPTIMIZERS)
  args.clips = choices(p, "--clips", args.clips, train_step.CLIPS)
  return args


def main(argv=None):
  args = parse_args(argv)
  torch, torch_note = (None, "--no-torch") if args.no_torch else torch_baseline.import_torch()
  meta = record.run_metadata(args)
  meta.update(torch=torch.__version__ if torch else None, torch_skipped=torch_note or None,
              max_norm=MAX_NORM, floor_bytes_per_N=FLOOR_N,
              learning_rate=train_step.LEARNING_RATE)
  out = args.out or record.default_out_path("bench_step", meta)
  bw = timing.copy_bandwidth(COPY_BYTES if not args.quick else 1 << 24, 10, args.repeats)
  meta["copy_bandwidth_GBps"] = bw / 1e9
  log(f"{meta['device_kinds'][0]} ({meta['backend']}): jax {meta['jax']}, optax "
      f"{meta['optax']}, clipjax {meta['clipjax']}, torch {meta['torch']}; copy bandwidth "
      f"{bw / 1e9:.0f} GB/s")
  results = {"meta": meta, "checks": [], "rows": []}
  mesh = jax.make_mesh((1,), (AXIS,))
  meta["skipped"] = []
  for model in args.models:
    for dtype in args.dtypes:
      layout = Layout("single", mesh, gpt_grad_spec(model, dtype))
      leaves = jax.tree.leaves(gpt_grad_spec(model, dtype))
      n_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
      log(f"{model} {dtype}: {len(leaves)} leaves, N = {n_bytes / 1e6:.1f} MB, one read "
          f"{n_bytes / bw * 1e6:.1f} us")
      if not args.no_checks:
        results["checks"] += [dict(c, model=model) for c in check(layout, dtype)]
      for regime in args.regimes:
        for opt in args.optimizers:
          if args.max_seconds and log.elapsed() > args.max_seconds:
            meta["skipped"].append(f"{model} {dtype} {regime} {opt}")
            continue
          base = dict(model=model, dtype=dtype, regime=regime, n_bytes=n_bytes,
                      read_us=n_bytes / bw * 1e6, floor_us=FLOOR_N * n_bytes / bw * 1e6)
          for clip in args.clips:
            r = train_step.bench(clip, layout, args, opt=opt, max_norm=MAX_NORM[regime])
            results["rows"].append(dict(base, framework="jax", **r))
            log(f"  {regime:6s} {r['label']:40s} device {num(r.get('us_device'), 8)} us  "
                f"in-jit {num(r['us_injit'], 8)} us  (compile {r['compile_s']} s)")
            record.save_json(results, out, complete=False)
          if torch and opt == "adamw":
            for variant, r in torch_baseline.graph_steps(
                torch, model, dtype, regime, args, train_step.LEARNING_RATE, 0.1).items():
              label = "torch fused adamw alone" if variant == "adamw" else \
                      "torch clip_grad_norm_ + fused adamw"
              results["rows"].append(dict(base, framework="torch", clip=variant, opt="adamw",
                                          label=label, **r))
              log(f"  {regime:6s} {label:40s} device {num(r.get('us_device'), 8)} us")
  add_ratios(results["rows"])
  finish(results, out)


def check(layout, dtype):
  """Before timing: each chain's first moment against float64 and against optax's chain
  (train_step.check_chains), and one step with scale="fused" against scale="kernel"."""
  checks = train_step.check_chains(layout, dtype)
  after = {clip: train_step.one_step(clip, layout)[0] for clip in ("andrea", "andrea_kernel")}
  worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                           / np.maximum(np.abs(np.asarray(b, np.float64)), 1e-30), initial=0.0))
              for a, b in zip(jax.tree.leaves(after["andrea"]),
                              jax.tree.leaves(after["andrea_kernel"])))
  tol = train_step.PARAMS_RTOL[dtype]
  checks.append({"layout": layout.name, "dtype": dtype, "value": worst, "tol": tol,
                 "what": "step: parameters, scale=fused vs scale=kernel (elementwise)",
                 "ok": worst <= tol})
  return checks


def add_ratios(rows):
  """x floor, the clip's cost (the step minus the optimizer alone, same framework), that cost
  in reads of the gradients, and the speed-ups over optax's chain and torch's step."""
  def find(row, clip, framework):
    for r in rows:
      if ((r["model"], r["dtype"], r["regime"], r["opt"], r["clip"], r["framework"]) ==
          (row["model"], row["dtype"], row["regime"], row["opt"], clip, framework)):
        return r
    return None

  def t(r):  # the device time; on a CPU (no profiler), the wall time per call
    return (r.get("us_device") or r.get("us_injit")) if r else None

  for row in rows:
    row["x_floor"] = t(row) / row["floor_us"] if t(row) else None
    alone = find(row, "none" if row["framework"] == "jax" else "adamw", row["framework"])
    row["clip_us"] = t(row) - t(alone) if t(row) and t(alone) and alone is not row else None
    row["clip_reads"] = row["clip_us"] / row["read_us"] if row["clip_us"] is not None else None
    optax_row, torch_row = find(row, "optax", "jax"), find(row, "torch", "torch")
    row["vs_optax"] = t(optax_row) / t(row) if t(optax_row) and t(row) else None
    row["vs_torch"] = t(torch_row) / t(row) if t(torch_row) and t(row) else None


def finish(results, out):
  meta = results["meta"]
  columns = [("model", -8, lambda r: r["model"]), ("dtype", -5, lambda r: r["dtype"]),
             ("regime", -6, lambda r: r["regime"]), ("step", -40, lambda r: r["label"]),
             ("time", 8, lambda r: r.get("us_device") or r.get("us_injit")),
             ("x floor", 7, lambda r: (r["x_floor"], 2)),
             ("clip", 7, lambda r: r["clip_us"]),
             ("clip/N", 6, lambda r: (r["clip_reads"], 2)),
             ("vs optax", 8, lambda r: (r["vs_optax"], 2)),
             ("vs torch", 8, lambda r: (r["vs_torch"], 2))]
  print("\n" + tables.render(
      f"TRAINING STEP, one device, us per step. floor: {FLOOR_N}N bytes at "
      f"{meta['copy_bandwidth_GBps']:.0f} GB/s", columns, results["rows"],
      "time: the GPU's busy time per step (profiler; torch: CUDA graph replay; on a CPU, the "
      "wall time per call). floor: 7N "
      "for AdamW, N for the norm, 2N for the pass that materializes the gradients. clip: "
      "the step minus the optimizer alone; clip/N: that over one read of the gradients. vs "
      "optax, vs torch: their step's time over this row's."))
  meta["passed"] = all(c["ok"] for c in results["checks"])
  failed = [c for c in results["checks"] if not c["ok"]]
  print(f"\ncorrectness: {'PASS' if meta['passed'] else 'FAIL'} ({len(results['checks'])} "
        "checks" + (": failed " + "; ".join(f"{c['model']} {c['dtype']} {c['what']} = "
                                            f"{c['value']}" for c in failed) if failed else "")
        + ")", flush=True)
  if meta["skipped"]:
    print("skipped (over --max-seconds): " + "; ".join(meta["skipped"]))
  record.save_json(results, out, complete=True)
  log(f"wrote {out}")
  if not meta["passed"]:
    sys.exit(1)


if __name__ == "__main__":
  main()
