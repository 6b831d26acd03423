"""The example's speed: its training loop against the bare step, and the step's variants.

Of the three training-step benchmarks this one alone runs the example's own loop (its
batches, metrics and logging) and the model's variants (attention, dtype, remat, batch):
tokens per second and MFU. examples/benchmark.py compares the clips in one step;
benchmarks/bench_step.py the optimizer's step against the memory floor.

Two measurements on the visible devices, printed as tables and written to OUT_DIR
(results.json, report.md):

1. Loop against step. The example's own training (`loop.start`, then `steps.run_steps`:
   the bandit's batches made on a thread and put on the devices a step ahead, metrics
   fetched every --log-every steps, the metrics log) against the bare step: the same
   compiled function called on one fixed batch already on the devices, nothing fetched
   until the round's end. Same model, settings and batch size; --rounds rounds of
   --round-steps steps, the two taking turns (which goes first alternates), after one
   warm-up round each. Checkpoints are off; the loop's run is OUT_DIR/loop-run.
   Tokens/s is the median over rounds; the target is a loop at 0.97 or more of the step.
2. Variants of the step. For each --variants entry (attention implementation, dtype,
   remat, batch size) the bare step, timed the same way with the variants taking turns:
   tokens/s, step time, MFU (throughput.py), compile time and the compiled program's
   peak memory; and, on a GPU, where the first variant's step spends its time: its
   longest kernels over --profile-steps steps under JAX's profiler.

One H200, about 5 minutes (the default corpus's tokenizer is trained first if
--cache-dir has none):

    python examples/experiments/bench_speed.py --out-dir OUT
    python examples/experiments/bench_speed.py --config tiny --batch-size 8 \\
        --context-length 32 --vocab-size 512 --max-source-mb 0.05 --rounds 2 \\
        --round-steps 4 --variants 'remat=none;remat=block' --out-dir OUT   # a CPU
"""

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

if __name__ == "__main__":  # run as a script: the example's package is one folder up, the
  # benchmarks' record writer beside the example
  EXAMPLES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path[:0] = [EXAMPLES, os.path.join(os.path.dirname(EXAMPLES), "benchmarks")]

import exp_common  # noqa: E402
from benchlib import record  # noqa: E402
from gpt import config  # noqa: E402
from gpt.data import pipeline  # noqa: E402
from gpt.reports import throughput  # noqa: E402
from gpt.training import loop, sharding, steps, train_step as train_step_lib  # noqa: E402

# attention, dtype, remat, batch: what each does to andrea-120m's step on a GPU. The first
# is the example's default there; the second its default before cuDNN attention.
DEFAULT_VARIANTS = ("attention=cudnn,dtype=bfloat16;attention=xla,dtype=float32;"
                    "attention=xla,dtype=bfloat16;attention=cudnn,dtype=bfloat16,remat=dots;"
                    "attention=cudnn,dtype=bfloat16,remat=block;"
                    "attention=cudnn,dtype=bfloat16,batch_size=32")
VARIANT_KEYS = {"attention": str, "dtype": str, "remat": str, "batch_size": int}


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="andrea-120m")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--context-length", type=int)
  p.add_argument("--vocab-size", type=int)
  p.add_argument("--max-source-mb", type=float)
  p.add_argument("--cache-dir")
  p.add_argument("--log-every", type=int, default=config.TrainConfig.log_every,
                 help="the loop's, as train_gpt.py's")
  p.add_argument("--variants", default=DEFAULT_VARIANTS,
                 help="';'-separated, each ','-separated key=value of "
                      f"{', '.join(VARIANT_KEYS)}; a variant the platform cannot run is "
                      "reported as skipped")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--round-steps", type=int, default=20)
  p.add_argument("--profile-steps", type=int, default=3,
                 help="steps of the first variant traced for its kernel times (GPU); 0: none")
  p.add_argument("--skip-loop", action="store_true", help="only the variants")
  p.add_argument("--out-dir", default="runs/bench-speed")
  return p.parse_args(argv)


def base_config(args, **settings) -> config.TrainConfig:
  given = {k: getattr(args, k) for k in ("batch_size", "context_length", "vocab_size",
                                         "max_source_mb", "cache_dir", "log_every")
           if getattr(args, k) is not None}
  return config.TrainConfig(config=args.config, progress=False, plot=False, num_samples=0,
                            checkpoint_every=10**9, **{**given, **settings})


def parse_variant(text: str) -> dict:
  variant = {}
  for part in filter(None, text.split(",")):
    key, _, value = part.partition("=")
    if key not in VARIANT_KEYS:
      raise SystemExit(f"--variants: unknown key {key!r} in {text!r}")
    variant[key] = VARIANT_KEYS[key](value)
  return variant


# --- The step alone -----------------------------------------------------------------


class BareStep:
  """The training step of `cfg` on one fixed batch of the example's data (`streams`, the
  token streams of its sources) already on the devices: `step_fn` (the loop's, compiled
  when the loop first runs), or else one made and compiled here (its compile time and the
  compiled program's peak memory are kept). Real text, not random tokens: its repeated
  tokens make the embedding's gradient a different sum (docs/performance.md, "The
  example's speed")."""

  def __init__(self, cfg: config.TrainConfig, streams, step_fn=None):
    self.cfg = cfg
    mesh = loop.make_mesh(cfg)
    graphdef, self.params = loop.init_model(cfg, mesh)
    tx = train_step_lib.make_optimizer(cfg)
    self.opt_state = loop.init_opt_state(tx, self.params, mesh)
    model_cfg = loop.model_config(cfg)
    self.flops_per_token = throughput.flops_per_token(
        self.params, num_layers=model_cfg.num_layers, d_model=model_cfg.d_model,
        context_length=cfg.context_length)
    batch = pipeline.sample_batch(streams, np.full(3, 1 / 3), seed=0, step=1,
                                  batch_size=cfg.batch_size,
                                  context_length=cfg.context_length)
    rows = sharding.batch_sharding(mesh)
    self.batch = (jax.device_put(batch.tokens_BxL1, rows), jax.device_put(batch.source_B, rows))
    self.step = 0
    self.compile_s = self.peak_bytes = None
    self.step_fn = step_fn
    if step_fn is None:
      started = time.perf_counter()
      self.step_fn = train_step_lib.make_train_step(
          graphdef, tx, cfg, 3, mesh, self.params, self.opt_state).lower(
              self.params, self.opt_state, *self.batch, np.int32(1)).compile()
      self.compile_s = time.perf_counter() - started
      memory = self.step_fn.memory_analysis()
      self.peak_bytes = getattr(memory, "peak_memory_in_bytes", None) if memory else None

  def run(self, count: int) -> float:
    """Seconds for `count` steps, from the first dispatch until the last one's metrics
    are ready."""
    started = time.perf_counter()
    for _ in range(count):
      self.step += 1
      self.params, self.opt_state, m = self.step_fn(self.params, self.opt_state,
                                                    *self.batch, np.int32(self.step))
    jax.block_until_ready(m)
    return time.perf_counter() - started


def tokens_per_s(cfg, count: int, seconds: list[float]) -> float:
  return cfg.batch_size * cfg.context_length * count / statistics.median(seconds)


# --- The two measurements -----------------------------------------------------------


def loop_against_step(args) -> dict:
  total = (args.rounds + 1) * args.round_steps
  # Its last step, which saves a checkpoint, is not reached.
  cfg = base_config(args, steps=total + 1, out_dir=os.path.join(args.out_dir, "loop-run"),
                    overwrite=True)
  run = loop.start(cfg)
  try:
    cfg = run.loop.cfg
    bare = BareStep(cfg, run.data.streams, step_fn=run.loop.train_step)
    times = {"loop": [], "step": []}

    def loop_round():
      started = time.perf_counter()
      steps.run_steps(run.loop, run.state, until=run.state.step_done + args.round_steps)
      return time.perf_counter() - started

    rounds = {"loop": loop_round, "step": lambda: bare.run(args.round_steps)}
    for name in ("loop", "step"):
      rounds[name]()  # warm-up: the compile, the first phase's batches
    for r in range(args.rounds):
      for name in (("loop", "step") if r % 2 == 0 else ("step", "loop")):
        times[name].append(rounds[name]())
  except BaseException:
    loop.finish(run)
    run.loop.run_dir.close(failed=True)
    raise
  loop.finish(run)
  run.loop.run_dir.close()
  rates = {name: tokens_per_s(cfg, args.round_steps, t) for name, t in times.items()}
  return {"config": cfg.config, "batch_size": cfg.batch_size,
          "context_length": cfg.context_length, "dtype": cfg.dtype,
          "attention": cfg.attention, "remat": cfg.remat, "log_every": cfg.log_every,
          "round_seconds": times, "tokens_per_s": rates,
          "ratio": rates["loop"] / rates["step"],
          "mfu": {n: throughput.mfu(r, run.loop.flops_per_token, run.loop.peak_flops)
                  for n, r in rates.items()}}


def step_variants(args) -> tuple[list[dict], dict | None]:
  """A row per variant, and the first variant's kernel times (kernel_times)."""
  built, rows = [], []
  streams = loop.load_data(config.resolve(base_config(args))).streams
  for text in filter(None, args.variants.split(";")):
    variant = parse_variant(text)
    try:
      cfg = config.resolve(base_config(args, **variant))
    except config.ConfigError as e:
      rows.append({"variant": text, "skipped": str(e)})
      continue
    bare = BareStep(cfg, streams)
    bare.run(2)  # warm-up
    print(f"variant {text}: compiled in {bare.compile_s:.1f} s", flush=True)
    built.append((text, bare, []))
  for r in range(args.rounds):
    for _, bare, seconds in (built if r % 2 == 0 else built[::-1]):
      seconds.append(bare.run(args.round_steps))
  peak = throughput.peak_flops(jax.devices())
  for text, bare, seconds in built:
    rate = tokens_per_s(bare.cfg, args.round_steps, seconds)
    rows.append({"variant": text, "batch_size": bare.cfg.batch_size, "dtype": bare.cfg.dtype,
                 "attention": bare.cfg.attention, "remat": bare.cfg.remat,
                 "tokens_per_s": rate, "step_ms": 1e3 * statistics.median(seconds) /
                 args.round_steps, "mfu": throughput.mfu(rate, bare.flops_per_token, peak),
                 "tflops_per_s": rate * bare.flops_per_token / 1e12,
                 "compile_s": bare.compile_s, "peak_bytes": bare.peak_bytes,
                 "round_seconds": seconds})
  kernels = built and kernel_times(built[0][1], args.profile_steps)
  return rows, {"variant": built[0][0], "kernels": kernels} if kernels else None


def kernel_times(bare: BareStep, count: int, top: int = 15) -> list[dict] | None:
  """The `top` kernels of the most GPU time over `count` steps (ms per step, share of the
  step's kernel time), from a profiler trace; None where there is no GPU."""
  if jax.default_backend() != "gpu" or count <= 0:
    return None
  trace_dir = tempfile.mkdtemp(prefix="bench-speed-trace-")
  try:
    jax.profiler.start_trace(trace_dir)
    try:
      bare.run(count)
    finally:
      jax.profiler.stop_trace()
    totals = {}
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
          for line in plane.lines:
            if line.name.startswith("Stream"):
              for e in line.events:
                totals[e.name] = totals.get(e.name, 0) + e.duration_ns
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)
  whole = sum(totals.values()) or 1
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
  return [{"kernel": name[:120], "ms_per_step": ns / 1e6 / count, "share": ns / whole}
          for name, ns in ranked]


def report(results: dict) -> str:
  fmt, meta = exp_common.fmt, results["meta"]
  lines = [f"`{meta['command']}` on {meta['device_count']} x {meta['device_kinds'][0]}, jax "
           f"{meta['jax']}, {meta['date']}", ""]
  if (lp := results.get("loop_against_step")) is not None:
    lines += [f"Loop against step: {lp['config']}, {lp['batch_size']} x "
              f"{lp['context_length']}, {lp['dtype']}, attention {lp['attention']}, "
              f"--log-every {lp['log_every']}", "", exp_common.md_table(
                  ["", "tokens/s (median)", "MFU", "rounds (s)"],
                  [[name, f"{lp['tokens_per_s'][name]:,.0f}", _pct(lp["mfu"][name]),
                    " ".join(f"{t:.3f}" for t in lp["round_seconds"][name])]
                   for name in ("loop", "step")]),
              "", f"The loop runs at **{lp['ratio']:.3f}x** the bare step (target 0.97).", ""]
  rows = [[v["variant"], v.get("batch_size", ""), "skipped: " + v["skipped"], "", "", "", "",
           ""] if "skipped" in v else
          [v["variant"], v["batch_size"], f"{v['tokens_per_s']:,.0f}", f"{v['step_ms']:.1f}",
           f"{v['tflops_per_s']:.0f}", _pct(v["mfu"]), f"{v['compile_s']:.0f}",
           fmt(None if v["peak_bytes"] is None else v["peak_bytes"] / 2**30)]
          for v in results["variants"]]
  lines += ["Variants of the step:", "", exp_common.md_table(
      ["variant", "batch", "tokens/s", "step (ms)", "TFLOP/s", "MFU", "compile (s)",
       "peak memory (GiB)"], rows)]
  if results["kernels"]:
    lines += ["", f"Where the step of {results['kernels']['variant']} spends its GPU "
              "time:", "", exp_common.md_table(
                  ["kernel", "ms per step", "share"],
                  [[k["kernel"], f"{k['ms_per_step']:.2f}", _pct(k["share"])]
                   for k in results["kernels"]["kernels"]])]
  return "\n".join(lines) + "\n"


def _pct(x) -> str:
  return "n/a" if x is None else f"{x:.1%}"


def write(out_dir: str, results: dict, markdown: str, complete: bool) -> None:
  """OUT_DIR/results.json (the benchmarks' record) and OUT_DIR/report.md."""
  record.save_json(results, os.path.join(out_dir, "results.json"), complete)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown)


def main(argv=None) -> dict:
  args = parse_args(argv)
  results = {"meta": record.run_metadata(args, exp_common.command("bench_speed.py", argv)),
             "flops_formula": "6 N + 12 * layers * d_model * context (throughput.py)",
             "peak_flops_per_s": throughput.peak_flops(jax.devices())}
  if not args.skip_loop:
    results["loop_against_step"] = loop_against_step(args)
    write(args.out_dir, results, "", complete=False)  # kept should the variants not end
  results["variants"], results["kernels"] = step_variants(args)
  markdown = report(results)
  print(markdown)
  write(args.out_dir, results, markdown, complete=True)
  return results


if __name__ == "__main__":
  exp_common.run_cli(main)
