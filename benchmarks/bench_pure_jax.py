"""The pure-JAX path (what CPUs and TPUs run) against optax on one device: the norm alone
and the whole clip, each one jitted call on a GPT's gradients.

Device time per call is the GPU's busy time under the profiler over 20 calls (the union of
its kernels' intervals), with the number of kernels; on a CPU, where there is no device
trace, the median wall time of 20 calls. Prints one table and writes JSON.

    python benchmarks/bench_pure_jax.py                      # gpt120m, float32
    python benchmarks/bench_pure_jax.py --model gpt12m --dtype bf16
    python benchmarks/bench_pure_jax.py --quick              # tiny shapes, on a CPU

The pure-JAX path is timed both ways it can finish the leaves' sums of squares: by rows
(what it does on CUDA GPUs) and leaf by leaf (elsewhere), so that one command says which
is faster on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from benchlib import profiling, record, tables, trees
from clipjax._backend import pure_jax as _jax_impl

CALLS = 20
MAX_NORM = 1e-3  # below the trees' norms: every clip scales


def functions():
  """{row: function of the leaves}: the pure-JAX path's norm and clip with each way of
  finishing the leaves' sums (by rows, as on CUDA GPUs, and leaf by leaf, as elsewhere;
  `_jax_impl.ROW_SUM_PLATFORMS`), and optax's."""
  clip = optax.clip_by_global_norm(MAX_NORM)
  return {
      "pure JAX norm, by rows": pure_jax(by_rows=True, scale_leaves=False),
      "pure JAX norm, whole leaves": pure_jax(by_rows=False, scale_leaves=False),
      "optax norm": optax.global_norm,
      "pure JAX clip, by rows": pure_jax(by_rows=True, scale_leaves=True),
      "pure JAX clip, whole leaves": pure_jax(by_rows=False, scale_leaves=True),
      "optax clip": lambda ls: clip.update(ls, clip.init(ls))[0],
  }


def pure_jax(*, by_rows, scale_leaves):
  """The pure-JAX clip of the leaves in one form (`_jax_impl.clip_leaves`, which
  `clipjax.clip_tree(impl="jax")` runs in this platform's form): the clipped leaves, or the
  global norm alone."""
  def fn(leaves):
    out, norms, _ = _jax_impl.clip_leaves(MAX_NORM, leaves, mode="global",
                                          on_nonfinite="propagate", scale_leaves=scale_leaves,
                                          by_rows=by_rows)
    return out if scale_leaves else norms[0]
  return fn


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
  record.save_rows("bench_pure_jax", args, rows)


if __name__ == "__main__":
  main()
