"""The real training step on the clock a user reads: the example's GPT (gpt/model.py)
forward, backward, clip and AdamW, one jitted call per step, parameters and optimizer state
donated, no metrics fetched.

Of the three training-step benchmarks this one alone holds the clip to its targets in a
whole step, on wall, dispatch, host and device time, beside optax's clip and torch's.
benchmarks/bench_step.py reads the optimizer's step alone (gradients as inputs) against
the memory floor; experiments/bench_speed.py the example's training loop against its step.

For each model, batch and gradient dtype, the variants run in interleaved rounds (each round
runs every variant for --steps steps, the order rotating from round to round, so that drift
hits each alike), and each is read on four clocks:
  - wall per step: from the first call of a round until its last step's results are ready,
    over the steps;
  - dispatch per step: the host's time inside the jitted calls (until each call returns);
    where the GPU sets the pace this includes the wait for a free slot in the queue;
  - host per step: the host's time inside one call, for --host-steps more steps per round,
    each called with the GPU idle and nothing queued, so that no wait for the queue is in
    it; a round gives the median of its calls (a call that finds the GPU idle may pay a
    start of its own: compare it within a case);
  - device per step: the GPU's busy time, from a profiled round (benchlib.profiling).
The tables give the median over rounds and the spread (lowest to highest round), each
variant against adamw alone as a ratio of medians ("vs") and as the median of the
rounds' own ratios ("paired": each round's wall or host time over adamw alone's in the
same round, so that drift between rounds cancels). adamw alone compiled a second time
("none_again", a control) shows how far two runs of one program differ on each clock.
Python's garbage collector is off while a round is timed.

Each clip's step is then held to the targets of docs/performance.md (benchlib.targets):
wall within 2% of adamw alone, no slower than optax's chain, host within 5% of adamw alone,
each on the paired ratio. A verdict reads the 95% interval of that ratio's median
(benchlib.timing.median_interval): "met" where all of it is within the bound, "not met"
where none of it is, "cannot tell" where the rounds cannot resolve it (more rounds, or more
steps a round, narrow the interval; docs/development.md, "Timing", says how). The control is
read against adamw alone too, as a measure of what the rounds resolve.

Gradient dtype f32: float32 parameters, bfloat16 compute (the example's setting); bf16: the
parameters, and so the gradients and AdamW's moments, in bfloat16.

Beside them, where torch sees a GPU, the same model in torch (benchlib.torch_gpt), stepped
eagerly as a torch user writes it: fused AdamW alone, and after clip_grad_norm_. Its rows
are timed in the same rounds, and their "vs" is over torch's AdamW alone. Without torch or
a GPU they are left out, and the JSON says why. With torch's rows XLA does not preallocate
the GPU's memory, so that torch can share it; without them it does, as in a user's JAX
process.

    python examples/benchmark.py                # the GPU run
    python examples/benchmark.py --quick        # tiny model: a CPU run
    python examples/benchmark.py --cases andrea-120m:1:f32 --variants none,andrea
    python examples/benchmark.py --cases andrea-120m:1:bf16 --variants none,andrea --kernels 8

--kernels N says where a variant's device time goes: from the profiled round, each kernel
is classed by the kind of fusion XLA made and the shape it writes (gemm_fusion_dot
bf16[768,2304], wrapped_slice bf16[768,768], ...), and the N classes whose time per step
differs most from adamw alone's are printed, with their counts (the JSON holds every class),
and then what wrote each operand of the clip's custom calls (benchlib.profiling.call_operands):
a class that adamw alone's kernels lack is an array XLA wrote for the call. --hlo-dir keeps
each variant's optimized HLO, to read those fusions.

docs/performance.md has what it measured, from its records in docs/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import clipjax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

if __name__ == "__main__":  # run as a script: the timing harness is the benchmarks' own
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "benchmarks"))

from benchlib import profiling, record, state_split, tables, targets, timing  # noqa: E402
from benchlib.cli import Log, choices  # noqa: E402
from benchlib.torch_baseline import import_torch  # noqa: E402
from benchlib.torch_gpt import TorchRunner  # noqa: E402

from gpt import model as model_lib  # noqa: E402

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
LEARNING_RATE, WEIGHT_DECAY, MAX_NORM = 1e-5, 0.1, 1.0
# The clip ahead of adamw, by variant: max_norm -> GradientTransformation (None: no clip).
VARIANTS = {
    "none": ("adamw alone", None),
    # The control: the same step, compiled and timed as a variant of its own. What it is
    # off from adamw alone is what any two programs differ by on these clocks.
    "none_again": ("adamw alone, compiled again", None),
    "andrea": ("andrea_clip + adamw", lambda m: clipjax.andrea_clip(m)),
    "andrea_kernel": ("andrea_clip(scale=kernel)", lambda m: clipjax.andrea_clip(m, scale="kernel")),
    "andrea_fused": ("andrea_clip(scale=fused)", lambda m: clipjax.andrea_clip(m, scale="fused")),
    "andrea_jax": ("andrea_clip(impl=jax)", lambda m: clipjax.andrea_clip(m, impl="jax")),
    "optax": ("clip_by_global_norm + adamw", optax.clip_by_global_norm),
    # The clip's cost split in two (benchlib.state_split): its state's arrays without the
    # clip, and the clip without its state.
    "none_state": ("adamw + clip-like state", state_split.carried_like_clip),
    "andrea_nostate": ("andrea_clip, no state kept", state_split.clip_without_state),
}
# torch's step on the same model: (label, clip_grad_norm_'s max_norm or None).
TORCH_VARIANTS = {
    "torch_adamw": ("torch: fused AdamW alone", None),
    "torch_clip": ("torch: clip_grad_norm_ + AdamW", MAX_NORM),
}
LABELS = {k: v[0] for k, v in {**VARIANTS, **TORCH_VARIANTS}.items()}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
PROFILED_STEPS = 5
DEFAULT_CASES = ("andrea-120m:1:f32,andrea-120m:1:bf16,andrea-120m:4:f32,andrea-120m:4:bf16,"
                 "andrea-120m:16:f32,andrea-120m:16:bf16,andrea-12m:4:f32,andrea-12m:4:bf16,"
                 "andrea-12m:16:f32,andrea-12m:16:bf16")
log = Log()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cases", default=DEFAULT_CASES,
                 help="comma list of MODEL:BATCH:DTYPE (models: " +
                 ", ".join(model_lib.MODEL_CONFIGS) + "; dtypes: f32, bf16)")
  p.add_argument("--variants",
                 default="none,none_again,andrea,andrea_kernel,andrea_jax,optax,torch_adamw,"
                 "torch_clip",
                 help="comma list of: " + ", ".join(LABELS))
  p.add_argument("--context-length", type=int, default=1024)
  p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
  p.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
  p.add_argument("--host-steps", type=int, default=20,
                 help="steps per variant per round timed with the GPU idle (host per step)")
  p.add_argument("--no-profile", action="store_true", help="skip the profiled round")
  p.add_argument("--trace-dir", default=None,
                 help="keep each variant's profiler trace (host and device rows) here")
  p.add_argument("--host-events", type=int, default=0,
                 help="print the host's time per step by profiler event, this many per variant")
  p.add_argument("--kernels", type=int, default=0,
                 help="print, for each variant, this many kernel classes whose device time "
                 "differs most from adamw alone's (from the profiled round)")
  p.add_argument("--max-seconds", type=float, default=0,
                 help="start no new case after this many seconds (0: no limit)")
  p.add_argument("--hlo-dir", default=None,
                 help="write each variant's optimized HLO module here (MODEL-bBATCH-DTYPE-"
                      "VARIANT.hlo.txt), to read the fusions XLA made")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
  p.add_argument("--quick", action="store_true", help="the tiny model, few steps: a CPU run")
  args = p.parse_args(argv)
  if args.quick:
    args.cases, args.context_length, args.steps, args.rounds = "tiny:2:f32,tiny:2:bf16", 64, 3, 6
    args.host_steps = 2
  if min(args.steps, args.rounds, args.host_steps) < 1:
    p.error("--steps, --rounds and --host-steps must be at least 1")
  args.variants = choices(p, "--variants", args.variants, LABELS)
  args.cases = [parse_case(p, c) for c in args.cases.split(",") if c.strip()]
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  return args


def parse_case(parser, text):
  try:
    name, batch, dtype = text.strip().split(":")
    batch = int(batch)
  except ValueError:
    parser.error(f"--cases: {text!r} is not MODEL:BATCH:DTYPE")
  if name not in model_lib.MODEL_CONFIGS or dtype not in DTYPES or batch < 1:
    parser.error(f"--cases: {text!r}: model one of {', '.join(model_lib.MODEL_CONFIGS)}, "
                 "batch >= 1, dtype f32 or bf16")
  return name, batch, dtype


def make_model(name, context_length, dtype):
  """(graphdef, params): the example's GPT with bfloat16 compute, its parameters in
  `dtype`."""
  cfg = model_lib.ModelConfig(**{**vars(model_lib.MODEL_CONFIGS[name]),
                                 "context_length": context_length, "dtype": "bfloat16"})
  graphdef, params = nnx.split(model_lib.GPT(cfg, nnx.Rngs(0)), nnx.Param)
  params = jax.tree.map(lambda x: x.astype(DTYPES[dtype]), params)
  return graphdef, params, cfg


def make_step(graphdef, tx):
  """step(params, opt_state, tokens_BxL1) -> (params, opt_state): the GPT's mean
  next-token cross-entropy over its full logits (the step that the torch baseline mirrors
  leaf for leaf; the example's own step pads the vocabulary, gpt/training/train_step.py),
  its gradients, the optimizer; the state donated."""
  def loss_fn(params, tokens_BxL1):
    logits_BxLxV = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV,
                                                           tokens_BxL1[:, 1:]).mean()

  def step(params, opt_state, tokens_BxL1):
    grads = jax.grad(loss_fn)(params, tokens_BxL1)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def chain(variant):
  make_clip = VARIANTS[variant][1]
  adamw = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  return optax.chain(make_clip(MAX_NORM), adamw) if make_clip else adamw


class Runner:
  """One variant's jitted step and its state, carried from round to round."""

  def __init__(self, variant, graphdef, params, tokens, hlo_path=None):
    tx = chain(variant)
    self.variant, self.tokens = variant, tokens
    self.fn = make_step(graphdef, tx)
    self.state = (jax.tree.map(jnp.copy, params), jax.jit(tx.init)(params))
    t0 = time.perf_counter()
    compiled = self.fn.lower(*self.state, tokens).compile()
    self.compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    if hlo_path:
      with open(hlo_path, "w") as f:
        f.write(hlo)
    self.hlo, self.shapes = profiling.hlo_summary(hlo), profiling.instruction_shapes(hlo)
    self.run(2)  # warm-up: the first calls after a compile are slower

  def run(self, steps, drained=False):
    """(wall seconds, [seconds inside each call]) of `steps` steps (`timing.timed_steps`)."""
    def step():
      self.state = self.fn(*self.state, self.tokens)

    return timing.timed_steps(lambda: jax.block_until_ready(self.state), step, steps, drained)

  def clip_facts(self):
    try:
      state = clipjax.clip_state(self.state[1])
    except ValueError:  # no clip in this chain
      return {}
    return {"global_norm": float(state.global_norm), "clipped": bool(state.clipped)}


def timed(runner, args):
  """{clock: ms per step} of a runner in one round: wall and dispatch per step over the
  round's steps, host the median of its drained calls (one call that the OS interrupts does
  not move it)."""
  wall, dispatch = runner.run(args.steps)
  _, host = runner.run(args.host_steps, drained=True)
  return {"wall": wall / args.steps * 1e3, "dispatch": sum(dispatch) / args.steps * 1e3,
          "host": statistics.median(host) * 1e3}


def make_runners(name, batch, dtype, args, torch):
  """The case's runners; torch's variants only where `torch` is given."""
  graphdef, params, cfg = make_model(name, args.context_length, dtype)
  tokens = jax.random.randint(jax.random.key(1), (batch, args.context_length + 1), 0,
                              cfg.vocab_size, jnp.int32)
  runners = []
  for v in args.variants:
    if v in TORCH_VARIANTS:
      if torch is None:
        continue
      runners.append(TorchRunner(torch, v, cfg, dtype, jax.device_get(tokens),
                                 clip_norm=TORCH_VARIANTS[v][1], learning_rate=LEARNING_RATE,
                                 weight_decay=WEIGHT_DECAY))
      log(f"{name} batch {batch} {dtype}: {v} ready")
    else:
      hlo_path = args.hlo_dir and os.path.join(args.hlo_dir,
                                               f"{name}-b{batch}-{dtype}-{v}.hlo.txt")
      runners.append(Runner(v, graphdef, params, tokens, hlo_path))
      log(f"{name} batch {batch} {dtype}: {v} compiled in {runners[-1].compile_s:.1f} s")
  return runners


def profile(runner, args, trace_name):
  """(device ms per step, {host event: ms per step}, {kernel class: [kernels, us] per step})
  from a profiled round."""
  keep = os.path.join(args.trace_dir, trace_name) if args.trace_dir else None
  planes = profiling.traced_planes(lambda: runner.run(PROFILED_STEPS), keep)
  gpus = [p for p in planes if p.name.startswith("/device:GPU")]
  busy = [v for v in (profiling.busy_seconds(list(p.lines)) for p in gpus) if v is not None]
  device_ms = max(busy) / PROFILED_STEPS * 1e3 if busy else None
  classes = profiling.kernel_classes([line for p in gpus for line in p.lines], runner.shapes)
  return device_ms, {k: v / PROFILED_STEPS * 1e3
                     for k, v in profiling.host_seconds(planes).items()}, {
      k: [n / PROFILED_STEPS, sec / PROFILED_STEPS * 1e6] for k, (n, sec) in classes.items()}


def bench_case(name, batch, dtype, args, torch):
  runners = make_runners(name, batch, dtype, args, torch)
  rounds = timing.interleaved_rounds(runners, args.rounds, lambda r: timed(r, args))
  clocks = {k: {r.variant: [ms[k] for ms in rounds[r]] for r in runners}
            for k in ("wall", "dispatch", "host")}
  rows = []
  for runner in runners:
    device_ms, events_ms, kernels_us = (None, {}, {}) if args.no_profile else profile(
        runner, args, f"{name}-b{batch}-{dtype}-{runner.variant}")
    rows.append({"model": name, "batch": batch, "dtype": dtype, "variant": runner.variant,
                 "label": LABELS[runner.variant],
                 "tokens_per_step": batch * args.context_length,
                 **{f"{k}_ms": timing.spread(v[runner.variant]) for k, v in clocks.items()},
                 "device_ms": device_ms, "host_ms_by_event": events_ms,
                 "device_us_by_kernel": kernels_us,
                 "compile_s": runner.compile_s,
                 "hlo": runner.hlo, **runner.clip_facts()})
  # JAX's rows against adamw alone, torch's against torch's AdamW alone.
  bases = {framework: next((r for r in rows if r["variant"] == v), None)
           for framework, v in (("jax", "none"), ("torch", "torch_adamw"))}
  for row in rows:
    base = bases["torch" if row["variant"] in TORCH_VARIANTS else "jax"]
    if base:
      for k in clocks:
        row[f"{k}_vs_adamw"] = row[f"{k}_ms"]["median"] / base[f"{k}_ms"]["median"]
      for k in ("wall", "host"):
        row[f"{k}_paired_vs_adamw"] = timing.spread(targets.paired_ratios(row, base, k))
  return rows


def table(rows):
  def ms(key):
    return lambda r: f"{r[key]['median']:.2f} ({r[key]['min']:.2f}-{r[key]['max']:.2f})"

  columns = [("model", -11, lambda r: r["model"]), ("B", 3, lambda r: (r["batch"], 0)),
             ("dtype", -5, lambda r: r["dtype"]), ("step", -30, lambda r: r["label"]),
             ("wall ms (spread)", 22, ms("wall_ms")),
             ("vs adamw", 8, lambda r: (r.get("wall_vs_adamw"), 3)),
             ("paired", 6, lambda r: (r.get("wall_paired_vs_adamw", {}).get("median"), 3)),
             ("dispatch ms (spread)", 22, ms("dispatch_ms")),
             ("vs adamw", 8, lambda r: (r.get("dispatch_vs_adamw"), 3)),
             ("host ms (spread)", 22, ms("host_ms")),
             ("vs adamw", 8, lambda r: (r.get("host_vs_adamw"), 3)),
             ("paired", 6, lambda r: (r.get("host_paired_vs_adamw", {}).get("median"), 3)),
             ("device ms", 9, lambda r: (r["device_ms"], 2)),
             ("fusions", 7, lambda r: (r["hlo"]["fusions"], 0))]
  return tables.render(
      "REAL TRAINING STEP (the example's GPT: forward, backward, clip, AdamW), ms per step",
      columns, rows,
      "wall: a round's time until its last step's results are ready, per step; dispatch: the "
      "host's time inside the calls, per step; host: the median call of a round's "
      "calls made with the GPU idle; medians over interleaved rounds, (lowest-highest "
      "round); vs adamw: over adamw alone's median (torch's rows: over torch's AdamW "
      "alone); paired: the median of the rounds' own ratios to adamw alone (wall, host); "
      "device: the GPU's busy time (profiler).")


def main(argv=None):
  args = parse_args(argv)
  torch_variants = [v for v in args.variants if v in TORCH_VARIANTS]
  torch, why = import_torch() if torch_variants else (None, "")
  if torch is not None:  # before JAX starts its backend
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  meta = record.run_metadata(args)
  out = args.out or record.default_out_path("train_step", meta)
  skipped = dict.fromkeys(torch_variants, why) if torch is None else {}
  results = {"meta": meta, "rows": [], "targets": [], "skipped": skipped}
  for name, batch, dtype in args.cases:
    if args.max_seconds and log.elapsed() > args.max_seconds:
      log(f"time budget spent: skipping {name} batch {batch} {dtype}")
      continue
    results["rows"] += bench_case(name, batch, dtype, args, torch)
    record.save_json(results, out, complete=False)
    case_rows = [r for r in results["rows"] if (r["model"], r["batch"], r["dtype"]) ==
                 (name, batch, dtype)]
    print(table(case_rows), flush=True)
    verdicts = targets.target_verdicts(case_rows)
    results["targets"] += verdicts
    if verdicts:
      print(targets.verdicts_text(verdicts), flush=True)
    for row in case_rows[:len(case_rows) if args.host_events else 0]:
      events = list(row["host_ms_by_event"].items())[:args.host_events]
      print(f"host ms per step by event, {row['label']}: " +
            "; ".join(f"{k[:60]} {v:.3f}" for k, v in events), flush=True)
    base = next((r for r in case_rows if r["variant"] == "none"), None)
    for row in case_rows if args.kernels else []:
      if row is base or row["variant"] not in VARIANTS:
        continue
      if base and base["device_us_by_kernel"]:
        deltas = profiling.kernel_deltas(row["device_us_by_kernel"],
                                         base["device_us_by_kernel"], args.kernels)
        print(f"device us per step by kernel class, {row['label']} against adamw alone "
              "(class: kernels there, here; us more): " + "; ".join(
                  f"{k} {n0:g}, {n1:g}: {us:+.1f}" for k, n0, n1, us in deltas), flush=True)
      operands = sorted(row["hlo"]["call_operands"].items(), key=lambda kv: -kv[1])
      if operands:
        print(f"the custom calls' operands by what wrote them, {row['label']}: " +
              "; ".join(f"{k} {n}" for k, n in operands), flush=True)
  print(table(results["rows"]))
  if results["targets"]:
    print(targets.verdicts_text(results["targets"]))
  for variant, why in results["skipped"].items():
    log(f"{variant} left out: {why}")
  record.save_json(results, out, complete=True)
  log(f"wrote {out}")


if __name__ == "__main__":
  main()
