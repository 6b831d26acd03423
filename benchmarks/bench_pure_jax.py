"""The pure-JAX path (what CPUs and TPUs run) against optax on one device: the norm alone
and the whole clip, each one jitted call on a GPT's gradients.

Device time per call is the GPU's busy time under the profiler over 20 calls (the union of
its kernels' intervals), with the number of kernels; on a CPU, where there is no device
trace, the median wall time of 20 calls. Prints one table and writes JSON.

    python benchmarks/bench_pure_jax.py                      # gpt120m, float32
    python benchmarks/bench_pure_jax.py --model gpt12m --dtype bf16
    python benchmarks/bench_pure_jax.py --quick              # tiny shapes, on a CPU

The pure-JAX path is timed both ways it can finish the leaves' sums of squares: by rows
(what it does on one GPU) and leaf by leaf (elsewhere), so that one command says which is
faster on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import clipjax
from benchlib import profiling, tables, trees
from clipjax import _jax_impl

CALLS = 20
MAX_NORM = 1e-3  # below the trees' norms: every clip scales


def functions():
  """{row: function of the leaves}: the pure-JAX path's norm and clip with each way of
  finishing the leaves' sums (`_jax_impl.use_row_sums` decides which it takes: row sums
  finished together on one GPU, whole leaves elsewhere), and optax's."""
  clip = optax.clip_by_global_norm(MAX_NORM)
  norm = lambda ls: clipjax.global_norm(ls, impl="jax")  # noqa: E731
  clipped = lambda ls: clipjax.clip_tree(ls, MAX_NORM, impl="jax").updates  # noqa: E731
  return {
      "pure JAX norm, by rows": with_row_sums(norm, True),
      "pure JAX norm, whole leaves": with_row_sums(norm, False),
      "optax norm": optax.global_norm,
      "pure JAX clip, by rows": with_row_sums(clipped, True),
      "pure JAX clip, whole leaves": with_row_sums(clipped, False),
      "optax clip": lambda ls: clip.update(ls, clip.init(ls))[0],
  }


def with_row_sums(fn, by_rows):
  """`fn`, traced with the pure-JAX path finishing its sums by rows or not."""
  def traced(leaves):
    chosen = _jax_impl.use_row_sums
    _jax_impl.use_row_sums = lambda: by_rows
    try:
      return fn(leaves)
    finally:
      _jax_impl.use_row_sums = chosen
  return traced


def measure(fn, leaves) -> dict:
  jitted = jax.jit(fn)
  for _ in range(4):
    out = jax.block_until_ready(jitted(leaves))

  def run():
    for _ in range(CALLS):
      out = jitted(leaves)
    jax.block_until_ready(out)

  walls = []
  for _ in range(5):
    start = time.perf_counter()
    run()
    walls.append((time.perf_counter() - start) / CALLS)
  lines = [line for plane in profiling.traced_gpu_planes(run) for line in plane.lines]
  busy = profiling.busy_seconds(lines)
  kernels = sum(sum(1 for _ in line.events) for line in lines if line.name.startswith("Stream"))
  del out
  return {"wall_us": statistics.median(walls) * 1e6,
          "device_us": busy / CALLS * 1e6 if busy else None,
          "kernels": kernels / CALLS if busy else None}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="gpt120m", choices=list(trees.MODELS))
  p.add_argument("--dtype", default="f32", choices=list(trees.DTYPES))
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
  p.add_argument("--quick", action="store_true", help="the tiny model")
  args = p.parse_args(argv)
  if args.quick:
    args.model = "tiny"
  leaves = jax.tree.leaves(trees.gpt_grad_spec(args.model, args.dtype))
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  leaves = [(jax.random.normal(k, x.shape, jnp.float32) * 1e-3).astype(x.dtype)
            for k, x in zip(keys, leaves)]
  rows = [{"what": name, **measure(fn, leaves)} for name, fn in functions().items()]
  print(tables.render(
      f"PURE JAX AGAINST OPTAX, us per call: {args.model} {args.dtype} ({len(leaves)} leaves) "
      f"on {jax.devices()[0].device_kind}",
      [("what", -28, lambda r: r["what"]), ("device", 9, lambda r: r["device_us"]),
       ("kernels", 8, lambda r: r["kernels"]), ("wall", 9, lambda r: r["wall_us"])],
      rows, "device: the GPU's busy time per call (profiler); kernels: per call; wall: "
            f"median over 5 rounds of {CALLS} calls."))
  tables.save_rows("bench_pure_jax", args, rows)


if __name__ == "__main__":
  main()
