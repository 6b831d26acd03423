"""Global-norm clipping alone on GPT-shaped gradients on one device: clipjax against optax,
torch and the memory floor (bench_step.py times it inside a training step).

One run measures the device's copy bandwidth, derives the memory floors from it, checks each
clip against float64, and times
  - the clip alone: clipjax.andrea_clip (the custom call), andrea_clip(impl="jax"),
    optax.clip_by_global_norm and torch.nn.utils.clip_grad_norm_(foreach=True), with the
    norm above max_norm (every repetition clips) and below it (none does).
It prints a table and writes everything, with versions and the command line, to JSON.

    python benchmarks/bench_clip.py            # the GPU run
    python benchmarks/bench_clip.py --quick    # tiny shapes: runs on a CPU in seconds

docs/development.md ("Timing") says how the timing works; docs/performance.md has what it
measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import clipjax  # noqa: E402
from benchlib import clips, profiling, record, tables, timing, torch_baseline  # noqa: E402
from benchlib.cli import Log, add_run_flags, choices  # noqa: E402
from benchlib.tables import num  # noqa: E402
from benchlib.timing import COPY_BYTES, REGIMES  # noqa: E402
from benchlib.trees import DTYPES, MODELS, Case, counts_note  # noqa: E402

IMPLS = clips.JAX_IMPLS + ("torch",)
log = Log()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default=None,
                 help="comma list of: " + ", ".join(MODELS) + " (default gpt120m,gpt12m)")
  p.add_argument("--dtypes", default="f32,bf16", help="comma list of: " + ", ".join(DTYPES))
  p.add_argument("--regimes", default="clip,noclip", help="comma list of: " + ", ".join(REGIMES))
  p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
  p.add_argument("--reps", type=int, default=10, help="the least K, clips per jitted call")
  p.add_argument("--optax-reps", type=int, default=4, help="the least K for optax")
  p.add_argument("--jax-reps", type=int, default=2, help="the least K for impl='jax'")
  p.add_argument("--no-scale-reps", action="store_true",
                 help="keep K as given (default: K clips move 50 GB, so the GPU, not the "
                      "host's dispatch, bounds a call)")
  p.add_argument("--unroll", type=int, default=None,
                 help="clips written out per in-jit call at most; more run in a loop "
                      "(default 80 custom call, 16 optax, 4 pure JAX)")
  add_run_flags(p, "bench_clip", iters=30)
  p.add_argument("--rotate-bytes", type=float, default=128e6,
                 help="rotate among copies of the tree so that this many bytes are touched "
                      "before a copy is read again (L2 does not hold them; 0: one copy)")
  p.add_argument("--probe", action="store_true",
                 help="also find out, from XLA's thunk dump, whether the custom call runs "
                      "inside a command buffer (a subprocess; about 80 s on an H200)")
  p.add_argument("--probe-dump-dir", default=None, help=argparse.SUPPRESS)
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few repetitions: runs on a CPU")
  args = p.parse_args(argv)
  if args.quick:
    args.models = args.models or "tiny"
    args.reps, args.optax_reps, args.jax_reps = 3, 3, 2
    args.unroll = 2  # K = 3 runs as 2 passes of 2: the loop runs too
    args.iters, args.repeats = 2, 2
    args.rotate_bytes, args.max_seconds, args.no_scale_reps = 0, 0, True
  args.models = choices(p, "--models", args.models or "gpt120m,gpt12m", MODELS)
  args.dtypes = choices(p, "--dtypes", args.dtypes, DTYPES)
  args.regimes = choices(p, "--regimes", args.regimes, REGIMES)
  args.impls = choices(p, "--impls", args.impls, IMPLS)
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.probe_dump_dir:
    print(json.dumps(probe_command_buffers(args)))
    return
  torch, torch_note = (torch_baseline.import_torch() if "torch" in args.impls
                       else (None, ""))
  andrea_impl, andrea_note = pick_andrea_impl() if "ffi" in args.impls else (None, "")
  for note in (torch_note and f"torch skipped: {torch_note}", andrea_note):
    if note:
      log(note)
  impls = [i for i in IMPLS if i in args.impls and (i != "ffi" or andrea_impl)
           and (i != "torch" or torch)]
  meta = record.run_metadata(args)
  meta.update(andrea_impl_arg=andrea_impl, andrea_impl_note=andrea_note or None,
              torch=torch.__version__ if torch else None, torch_skipped=torch_note or None,
              max_norm_decay_when_clipping=timing.DECAY,
              norm_over_max_norm_at_start={"clip": timing.NORM_RATIO,
                                           "noclip": 1 / timing.NORM_RATIO})
  log(f"{meta['device_kinds'][0]} ({meta['backend']}): jax {meta['jax']}, optax "
      f"{meta['optax']}, clipjax {meta['clipjax']}, torch {meta['torch']}")
  out = args.out or record.default_out_path("bench_clip", meta)
  results = {"meta": meta, "models": {}, "checks": [], "clip": []}

  copy_bytes = COPY_BYTES if not args.quick else 1 << 24
  meta["copy_bandwidth_GBps"] = {"jax": timing.copy_bandwidth(copy_bytes, 10, args.repeats) / 1e9}
  if torch:
    meta["copy_bandwidth_GBps"]["torch"] = torch_baseline.copy_bandwidth(
        torch, copy_bytes, 10, args.repeats) / 1e9
  bw = meta["copy_bandwidth_GBps"]["jax"] * 1e9  # the floors use JAX's copy
  log("copy bandwidth (bytes read + written), GB/s: " + ", ".join(
      f"{k} {v:.0f}" for k, v in meta["copy_bandwidth_GBps"].items()))
  meta["command_buffer"] = command_buffer_finding(args, impls)

  fns = clips.JaxFunctions(andrea_impl)
  meta["skipped"] = []
  # andrea_clip(impl="jax") compiles slowly: it runs after everything else.
  for first_pass, pass_impls in ((True, [i for i in impls if i != "jax"]),
                                 (False, [i for i in impls if i == "jax"])):
    for model in args.models if pass_impls else ():
      for dtype in args.dtypes:
        case = Case.make(model, dtype, args.rotate_bytes)
        if first_pass or model not in results["models"]:
          log(f"{model} {dtype}: {case.params / 1e6:.2f}M params, {case.leaves} leaves"
              f"{counts_note(model, case.params, case.leaves)}, {case.grad_bytes / 1e6:.1f} MB;"
              f" rotating {case.rotation} tree(s)")
        results["models"][model] = {"params": case.params, "leaves": case.leaves}
        results["checks"] += clips.check_clips(fns, [i for i in pass_impls if i != "torch"],
                                               case)
        for regime in args.regimes:
          if args.max_seconds and log.elapsed() > args.max_seconds:
            meta["skipped"].append(f"{model} {dtype} {regime}: {', '.join(pass_impls)}")
            log(f"  over --max-seconds: skipping {meta['skipped'][-1]}")
            continue
          run_case(case, regime, pass_impls, fns, torch, bw, results, args, out)
  finish(results, args, bw, out)


def run_case(case, regime, impls, fns, torch, bw, results, args, out):
  """Times the clips `impls` for one case and regime."""
  floors = {"clip": 3 * case.grad_bytes / bw * 1e6, "noclip": case.grad_bytes / bw * 1e6}
  base = dict(dataclasses.asdict(case), regime=regime, floor_us=floors[regime])

  def add(table, row):
    results[table].append(row)
    clips.add_ratios(results["clip"])
    record.save_json(results, out, complete=False)

  for impl in impls:
    t0 = log.elapsed()
    if impl == "torch":
      r = torch_baseline.bench_clip(torch, case, regime, args)
    else:
      r = clips.bench_clip(fns, impl, case, regime, args)
    add("clip", dict(base, table="clip", impl=impl, label=clips.LABELS[impl],
                     framework="torch" if impl == "torch" else "jax", **r))
    log_row("clip", regime, clips.LABELS[impl], r, log.elapsed() - t0)


def log_row(table, regime, label, r, seconds):
  text = (f"  {table} {regime:6s} {label:24s} in-jit {num(r.get('us_injit'), 9)} us  device "
          f"{num(r.get('us_device'), 9)} us  per call {num(r.get('us_call'), 9)} us")
  if "hlo_injit" in r:
    text += (f"  (K={r['reps']}" + (f" = {r['loops']} x {r['reps_written_out']}"
                                    if r.get("loops", 1) > 1 else "")
             + f", compile {r['hlo_injit']['compile_s']} s, case {seconds:.0f} s)")
  if r.get("regime_ok") is False:
    text += "  WARNING: the regime did not hold"
  log(text)
  if table == "clip" and r.get("kernels_us"):  # spans may overlap (early launch on sm_90)
    log("      kernel spans per clip: " + ", ".join(
        f"{profiling.short_kernel_name(name)} {us:.1f} us"
        for name, us in list(r["kernels_us"].items())[:4]))


def finish(results, args, bw, out):
  """Prints the tables, the checks and what was skipped; writes the JSON; exits 1 if a check
  failed."""
  meta = results["meta"]
  order = {impl: i for i, impl in enumerate(IMPLS)}
  results["clip"].sort(key=lambda r: (args.models.index(r["model"]), args.dtypes.index(r["dtype"]),
                                      args.regimes.index(r["regime"]), order[r["impl"]]))
  clips.add_ratios(results["clip"])
  print("\n" + tables.clip_table(results["clip"], bw))
  cb = meta["command_buffer"]
  print(f"\ncustom call inside an XLA command buffer: {cb['custom_call_in_command_buffer']}"
        f" ({cb['evidence']})")
  if meta["skipped"]:
    print("skipped (over --max-seconds): " + "; ".join(meta["skipped"]))
  meta["passed"] = all(c["ok"] for c in results["checks"])
  print(f"correctness: {'PASS' if meta['passed'] else 'FAIL'} (" + "; ".join(
      f"{c['model']} {c['dtype']} {c['impl']} {c['what']} {c['value']:.1e}"
      for c in results["checks"]) + ")", flush=True)
  meta["profiler_gpu_lines"] = sorted(profiling.PROFILER_LINES)
  record.save_json(results, out, complete=True)
  log(f"wrote {out}")
  if not meta["passed"]:
    sys.exit(1)


def pick_andrea_impl():
  """(impl, note): the impl= that reaches the custom call here, or None if none does.

  "ffi" where clipjax accepts it; on a GPU where it refuses, "auto" (which also lowers to
  the custom call on CUDA: the HLO counts in the JSON show whether it did).
  """
  probe = {"g": jnp.ones((4,), jnp.float32)}
  try:
    jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates).lower(probe)
    return "ffi", ""
  except Exception as e:  # noqa: BLE001 - reported on stdout and in the JSON
    note = f'impl="ffi" refused on backend {jax.default_backend()!r}: {str(e)[:300]}'
  if jax.default_backend() != "cpu":
    return "auto", note + ' -- timing impl="auto" instead'
  return None, note


# --- command buffers -----------------------------------------------------------------------


def command_buffer_finding(args, impls):
  """With --probe: whether XLA runs the custom call inside a command buffer (a CUDA graph),
  found by a child process of this script that has XLA dump its thunks (the timed process
  runs without dump flags)."""
  if not args.probe or "ffi" not in impls:
    why = "not probed (--probe not given)" if "ffi" in impls else "the custom call was not timed"
    return {"custom_call_in_command_buffer": None, "evidence": why}
  with tempfile.TemporaryDirectory(prefix="bench_clip_xla_dump_") as dump_dir:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {profiling.thunk_dump_flags(dump_dir)}"
    cmd = [sys.executable, os.path.abspath(__file__), "--probe-dump-dir", dump_dir,
           "--dtypes", args.dtypes[0], "--reps", str(args.reps)]
    done = None
    try:
      done = subprocess.run(cmd, env=dict(os.environ, XLA_FLAGS=flags.strip()),
                            capture_output=True, text=True, timeout=600)
      found = json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - the finding is then unknown, with the reason
      why = done.stderr[-500:] if done is not None else str(e)[-500:]
      found = {"custom_call_in_command_buffer": None,
               "evidence": f"the probe failed ({type(e).__name__}): {why}"}
  log(f"custom call inside an XLA command buffer: {found['custom_call_in_command_buffer']}")
  return found


def probe_command_buffers(args):
  """In the child: compiles a K-clip call with the custom call under the probe's name, on a tree with gpt120m's 197 leaves at tiny sizes (dumping a full-size module
  takes minutes), and reads where XLA put the custom call's thunks."""
  andrea_impl, _ = pick_andrea_impl()
  make_clip = clips.clip_transform("ffi", andrea_impl)
  case = Case.make("probe", args.dtypes[0], 0)
  clip_probe = clips.repeated_clip(make_clip, name=f"{profiling.PROBE}_clip")
  ms = timing.max_norm_schedule("clip", 1.0, args.reps)
  clip_probe.lower([case.random_tree(100)], tuple(ms)).compile()
  found = profiling.thunk_finding(args.probe_dump_dir, f"{profiling.PROBE}_clip")
  return {"custom_call_in_command_buffer": found["in_command_buffer"],
          "evidence": found["evidence"],
          "probed": f"{case.leaves} leaves ({case.dtype}), {args.reps} clips in one jitted call",
          "clip": found}


if __name__ == "__main__":
  main()
