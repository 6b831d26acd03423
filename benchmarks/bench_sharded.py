"""Global-norm clipping of gradients sharded over several devices: clipjax against optax.

One run builds GPT-shaped gradients, lays them out over a 1-D mesh ("data",) of every device,
checks the clips against a float64 reference, and times, K clips per jitted call, donated:
  - andrea:  clipjax.sharded_clip_tree(impl="auto"): each device runs the CUDA custom call on its
             own shards, and only per-leaf norms cross devices (on a CPU, where "auto" is pure
             JAX, impl="ffi" instead: the CPU handler; --andrea-impl chooses);
  - jax:     the same with impl="jax" (pure JAX in shard_map);
  - optax:   optax.clip_by_global_norm on the sharded tree (XLA's SPMD partitioner);
  - single:  clipjax.clip_tree, same impl as andrea, on one device holding the whole tree (the
             1-GPU time).
  - plain, plain_jax: clipjax.clip_tree (the drop-in, no mesh or specs) under jit on the
             sharded tree, partitioned by XLA: the custom call (as andrea) and pure JAX.
Layouts: "fsdp" (each leaf split on its first dimension the device count divides, else
replicated) and "replicated" (every leaf whole on every device, data parallel). It reports the
collectives in each compiled clip, the per-device memory floor, prints one table and writes JSON.

    python benchmarks/bench_sharded.py --out sharded.json           # the 2-GPU run
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python benchmarks/bench_sharded.py --quick --out /tmp/bs.json  # smoke test on a CPU

benchmarks/README.md says what is measured; the timing follows bench_clip.py, whose helpers
(shapes, copy bandwidth, timed rounds, max_norm schedule) are imported from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_clip  # noqa: E402  (sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless set)
from bench_clip import (  # noqa: E402
    COPY_BYTES, DTYPES, EXPECTED_COUNTS, MODELS, NORM_RATIO, REGIMES, WARMUP_CALLS, _num,
    busy_seconds, choices, f32_norm, gpt_grad_spec, jax_copy_bandwidth, max_norm_schedule,
    package_version, regime_holds, seconds_per_call, traced_gpu_planes)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import clipjax  # noqa: E402

F32 = jnp.float32
AXIS = "data"
LAYOUTS = ("fsdp", "replicated")
IMPLS = ("plain", "plain_jax", "andrea", "jax", "optax", "single")
SHARDED_IMPLS = ("plain", "plain_jax", "andrea", "jax", "optax")
LABELS = {"plain": "clip_tree under jit", "plain_jax": "clip_tree(jax) under jit",
          "andrea": "sharded_clip_tree", "jax": "sharded_clip_tree(jax)", "optax": "optax",
          "single": "clip_tree, 1 device"}
SEED = 100
PROFILED_CALLS = 3
# Correctness: the global norm and the updates against float64 NumPy. The updates are within
# the factor's rounding and one rounding to the leaf type: one ulp of that type at most.
# optax's updates are measured the same way and reported, not checked: on bf16 leaves its
# norm is a sum of bf16 values (about 3% off on gpt120m bf16).
NORM_RTOL = 1e-6
UPDATE_RTOL = {"f32": 1e-6, "bf16": 2.0**-7}
CUSTOM_CALL = 'custom_call_target="clipjax_andrea_'  # either call: the norms, the scale
COLLECTIVE_RE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                           r"collective-permute|collective-broadcast)(-start)?\(")


# --- layouts -----------------------------------------------------------------------------


def fsdp_spec(shape, n):
  """P("data") on the first dimension `n` divides, else P() (replicated)."""
  for i, d in enumerate(shape):
    if d % n == 0:
      return P(*([None] * i + [AXIS]))
  return P()


class Layout:
  """A way to place the gradient tree: its mesh specs, or one device (the "single" impl)."""

  def __init__(self, name, mesh, spec_tree):
    self.name, self.mesh = name, mesh
    if name == "single":
      self.specs = None
      self.shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), spec_tree)
      self.scalar = SingleDeviceSharding(jax.devices()[0])
    else:
      n = mesh.devices.size
      self.specs = jax.tree.map(
          lambda x: fsdp_spec(x.shape, n) if name == "fsdp" else P(), spec_tree)
      self.shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                                    is_leaf=lambda x: isinstance(x, P))
      self.scalar = NamedSharding(mesh, P())
    leaves, treedef = jax.tree.flatten(spec_tree)
    shardings = treedef.flatten_up_to(self.shardings)

    sizes = [math.prod(x.shape) for x in leaves]
    offsets = np.cumsum([0] + sizes)

    def make(key):
      # One random vector cut into the leaves: one random-number op to compile, not one
      # per leaf (197 of them took XLA about 100 s to compile on the GPU).
      flat = jax.random.normal(key, (int(offsets[-1]),), F32)
      return treedef.unflatten([flat[int(o):int(o) + n].reshape(x.shape).astype(x.dtype)
                                for o, n, x in zip(offsets, sizes, leaves)])
    self.make_tree = jax.jit(make, out_shardings=treedef.unflatten(shardings))

  def tree(self, seed=SEED):
    """Standard normals (the same values in every layout), placed as this layout says."""
    return self.make_tree(jax.random.key(seed))

  def max_norms(self, regime, norm0, n):
    return jax.device_put(max_norm_schedule(regime, norm0, n), self.scalar)

  def sharded_leaves(self):
    if self.specs is None:
      return 0
    return sum(1 for s in jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P)) if s)


def device_bytes(tree):
  """The largest number of bytes of the tree's shards that one device holds."""
  per_device = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())


# --- the clips ---------------------------------------------------------------------------


def clip_fn(impl, layout, andrea_impl):
  """(tree, max_norm) -> (clipped tree, global norm or None) for one impl on one layout."""
  if impl in ("plain", "plain_jax"):
    which = andrea_impl if impl == "plain" else "jax"

    def clip(tree, m):  # the drop-in: no mesh, no specs; XLA partitions it
      r = clipjax.clip_tree(tree, m, impl=which)
      return r.updates, r.global_norm
  elif impl in ("andrea", "jax"):
    which = andrea_impl if impl == "andrea" else "jax"

    def clip(tree, m):
      r = clipjax.sharded_clip_tree(tree, m, mesh=layout.mesh, specs=layout.specs, impl=which)
      return r.updates, r.global_norm
  elif impl == "single":
    def clip(tree, m):
      r = clipjax.clip_tree(tree, m, impl=andrea_impl)
      return r.updates, r.global_norm
  else:
    def clip(tree, m):
      tx = optax.clip_by_global_norm(m)
      return tx.update(tree, tx.init(tree))[0], None
  return clip


def check_fn(clip, layout):
  """jit(tree, max_norm) -> (updates, norm): one clip, not donated, for the correctness check."""
  return jax.jit(clip, in_shardings=(layout.shardings, layout.scalar),
                 out_shardings=(layout.shardings, layout.scalar))


def repeated_fn(clip, layout, name):
  """jit(tree, max_norms) -> tree: len(max_norms) clips, each output the next one's input.

  As in bench_clip.repeated_clip: unrolled, through an optimization barrier (no fusion of one
  repetition's scaling into the next one's norm), the tree donated, its sharding kept.
  """
  def run(tree, max_norms):
    for m in max_norms:
      tree = jax.lax.optimization_barrier(clip(tree, m)[0])
    return tree
  run.__name__ = name
  return jax.jit(run, in_shardings=(layout.shardings, layout.scalar),
                 out_shardings=layout.shardings, donate_argnums=0)


def hlo_summary(hlo):
  """Collectives (count per op, largest buffer in elements) and clipjax custom calls in HLO."""
  counts, largest = {}, 0
  for line in hlo.splitlines():
    m = COLLECTIVE_RE.search(line)
    if m:
      counts[m.group(2)] = counts.get(m.group(2), 0) + 1
      sizes = [math.prod(int(d) for d in dims.split(",") if d)
               for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]
      largest = max(largest, max(sizes, default=1))
  return {"collectives": counts, "collective_max_elements": largest if counts else 0,
          "custom_calls": hlo.count(CUSTOM_CALL)}


def collectives_text(h):
  if h is None:
    return "-"
  short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
           "collective-permute": "CP", "collective-broadcast": "CB"}
  if not h["collectives"]:
    return "none"
  ops = " ".join(f"{n} {short.get(op, op)}" for op, n in sorted(h["collectives"].items()))
  return f"{ops}, max {h['collective_max_elements']}"


def compile_timed(jitted, *args):
  t0 = time.perf_counter()
  hlo = jitted.lower(*args).compile().as_text()
  return hlo, round(time.perf_counter() - t0, 2)


# --- correctness -------------------------------------------------------------------------


def f64_norm(tree):
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    flat = np.asarray(leaf.astype(F32)).reshape(-1)
    for start in range(0, flat.size, 1 << 24):
      part = flat[start:start + (1 << 24)].astype(np.float64)
      total += float(np.dot(part, part))
  return math.sqrt(total)


def max_rel_err_vs_f64(got, tree, factor):
  """max |got - tree * factor| / |tree * factor| over every element, the product in float64
  on the host (0 / 0 counts as 0)."""
  worst = 0.0
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
    g = np.asarray(g.astype(F32)).reshape(-1)
    x = np.asarray(x.astype(F32)).reshape(-1)
    for start in range(0, x.size, 1 << 24):
      want = x[start:start + (1 << 24)].astype(np.float64) * factor
      diff = np.abs(g[start:start + (1 << 24)].astype(np.float64) - want)
      rel = np.where(diff == 0, 0.0, diff / np.maximum(np.abs(want), np.finfo(np.float64).tiny))
      worst = max(worst, float(rel.max(initial=0.0)))
  return worst


def run_checks(layout, dtype, impls, ref_norm, andrea_impl):
  """One clip per impl on the same tree: norms and updates against float64.

  Returns (rows of checks, {impl: hlo summary of one clip}).
  """
  m = jax.device_put(jnp.asarray(ref_norm / NORM_RATIO), layout.scalar)
  tree = layout.tree()
  outs, hlos, checks = {}, {}, []
  for impl in impls:
    t0 = time.perf_counter()
    fn = check_fn(clip_fn(impl, layout, andrea_impl), layout)
    hlo, compile_s = compile_timed(fn, tree, m)
    hlos[impl] = dict(hlo_summary(hlo), compile_s=compile_s)
    updates, norm = fn(tree, m)
    same_sharding = all(u.sharding.is_equivalent_to(t.sharding, u.ndim) for u, t in
                        zip(jax.tree.leaves(updates), jax.tree.leaves(tree)))
    outs[impl] = updates
    if norm is not None:
      err = abs(float(norm) - ref_norm) / ref_norm
      checks.append({"what": f"{impl} global norm vs float64", "value": err, "tol": NORM_RTOL,
                     "ok": err <= NORM_RTOL})
    checks.append({"what": f"{impl} output sharding as input", "value": None, "tol": None,
                   "ok": bool(same_sharding)})
    log(f"  checked {layout.name} {dtype} {LABELS[impl]} (compile {compile_s} s, "
        f"{time.perf_counter() - t0:.1f} s in all)")
  factor = float(m) / ref_norm
  for impl in ("plain", "plain_jax", "andrea", "jax", "single", "optax"):
    if impl in outs:
      err = max_rel_err_vs_f64(outs[impl], tree, factor)
      if impl == "optax":  # reported, not checked: see UPDATE_RTOL
        checks.append({"what": "optax updates vs float64 (not checked)", "value": err,
                       "tol": None, "ok": True})
      else:
        checks.append({"what": f"{impl} updates vs float64", "value": err,
                       "tol": UPDATE_RTOL[dtype], "ok": err <= UPDATE_RTOL[dtype]})
  for c in checks:
    c.update(layout=layout.name, dtype=dtype)
  return checks, hlos


# --- timing ------------------------------------------------------------------------------


def gpu_busy_by_device(run):
  """{GPU plane: seconds busy} while `run()` ran (bench_clip.busy_seconds, per device)."""
  try:
    busy = {}
    for plane in traced_gpu_planes(run, "bench_sharded_trace_"):
      seconds = busy_seconds(list(plane.lines))
      if seconds is not None:
        busy[plane.name] = seconds
    return busy
  except Exception as e:  # noqa: BLE001 - the device column is a bonus; say why it is empty
    return {"error": f"{type(e).__name__}: {e}"[:200]}


def time_clip(fn, layout, regime, norm0, K, cfg):
  """Microseconds per clip: in-jit wall time (median of rounds) and, on GPUs, device busy."""
  calls = cfg.iters

  def fresh(state):
    del state
    n = K * max(calls, WARMUP_CALLS, PROFILED_CALLS)
    return {"arrays": layout.tree(), "ms": layout.max_norms(regime, norm0, n)}

  def call(state, c):
    state["arrays"] = fn(state["arrays"], tuple(state["ms"][c * K:(c + 1) * K]))
    return state

  timing = seconds_per_call(fresh, call, calls, cfg.repeats, profile=False)
  ok = regime_holds(regime, [timing["state"]["arrays"]], norm0, K * timing["calls_since_fresh"])
  out = {"reps": K, "us_injit": timing["s"] / K * 1e6,
         "samples_injit_us": [s / K * 1e6 for s in timing["samples"]],
         "enqueue_fraction": timing["enqueue_fraction"], "us_device": None,
         "device_busy_us": None}
  del timing
  if not cfg.no_profile and jax.default_backend() != "cpu":
    holder = {"state": fresh(None)}
    jax.block_until_ready(holder["state"]["arrays"])

    def profiled():
      for c in range(PROFILED_CALLS):
        holder["state"] = call(holder["state"], c)
      jax.block_until_ready(holder["state"]["arrays"])
    busy = gpu_busy_by_device(profiled)
    per_dev = {k: v / (PROFILED_CALLS * K) * 1e6 for k, v in busy.items() if k != "error"}
    out["device_busy_us"] = per_dev or busy or None
    out["us_device"] = max(per_dev.values()) if per_dev else None
    ok = ok and regime_holds(regime, [holder["state"]["arrays"]], norm0, K * PROFILED_CALLS)
    del holder
  out["regime_ok"] = ok
  return out


# --- output ------------------------------------------------------------------------------


def add_ratios(rows):
  """x floor, speed-up over optax (same layout) and over the one-device clip, on device times
  where there are any."""
  def t(r):
    return r.get("us_device") or r.get("us_injit")

  def find(row, layout, impl):
    for r in rows:
      if (r["layout"], r["dtype"], r["regime"], r["impl"]) == (layout, row["dtype"],
                                                               row["regime"], impl):
        return r
    return None

  for row in rows:
    row["x_floor"] = t(row) / row["floor_us"]
    optax_row = find(row, row["layout"], "optax") if row["impl"] != "single" else None
    single = find(row, "single", "single")
    row["speedup_vs_optax"] = t(optax_row) / t(row) if optax_row else None
    row["speedup_vs_single"] = t(single) / t(row) if single else None


def table(rows, meta):
  cols = (f"{'layout':10s} {'dtype':5s} {'regime':6s} {'impl':22s} {'K':>3s} {'in-jit':>8s} "
          f"{'device':>8s} {'floor':>7s} {'x floor':>7s} {'vs optax':>8s} {'vs 1 dev':>8s} "
          f"{'cc':>3s}  collectives")
  n, kind = meta["device_count"], meta["device_kinds"][0]
  lines = [f"SHARDED CLIP, us per clip: {meta['model']} ({meta['params'] / 1e6:.2f}M params, "
           f"{meta['leaves']} leaves) over {n} x {kind}; floor: 3 x one device's bytes "
           f"(1 x not clipping) at {meta['copy_bandwidth_GBps']:.0f} GB/s; sharded_clip_tree "
           f"and clip_tree with impl=\"{meta['andrea_impl_arg']}\"", cols, "-" * len(cols)]
  for r in rows:
    lines.append(
        f"{r['layout']:10s} {r['dtype']:5s} {r['regime']:6s} {LABELS[r['impl']]:22s} "
        f"{r['reps']:3d} {_num(r['us_injit'], 8)} {_num(r['us_device'], 8)} "
        f"{_num(r['floor_us'], 7)} {_num(r['x_floor'], 7, 2)} {_num(r['speedup_vs_optax'], 8, 2)} "
        f"{_num(r['speedup_vs_single'], 8, 2)} {_num((r['hlo'] or {}).get('custom_calls'), 3, 0)}"
        f"  {collectives_text(r['hlo'])}")
  lines.append("in-jit: wall time of K clips in one jitted call, per clip; device: the busiest "
               "GPU's busy time per clip (profiler). x floor, vs optax (optax's time / this "
               "row's, same layout), vs 1 dev (the one-device clip's time / this row's) use "
               "device times where there are any. cc: clipjax custom calls in one compiled clip; "
               "collectives: in one compiled clip (AR all-reduce, AG all-gather, ...), max: the "
               "largest collective buffer in elements.")
  return "\n".join(lines)


def metadata(args, andrea_impl):
  devs = jax.devices()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": " ".join(["python"] + sys.argv),
      "backend": jax.default_backend(), "platform": devs[0].platform,
      "device_count": len(devs),
      "device_kinds": sorted({getattr(d, "device_kind", str(d)) for d in devs}),
      "jax": jax.__version__, "jaxlib": package_version("jaxlib"), "optax": optax.__version__,
      "clipjax": clipjax.__version__, "clipjax_ffi_platforms": list(clipjax.ffi_platforms()),
      "numpy": np.__version__, "python": platform.python_version(),
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "settings": {k: v for k, v in vars(args).items() if k != "out"},
      "andrea_impl_arg": andrea_impl,
      "norm_over_max_norm_at_start": {"clip": NORM_RATIO, "noclip": 1 / NORM_RATIO},
      "norm_rtol": NORM_RTOL, "update_rtol_vs_float64": UPDATE_RTOL,
  }


def default_out_path(meta):
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      f"sharded-{meta['date'][:10]}.json")


def save(results, path, complete):
  results["meta"]["complete"] = complete
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


# --- the run -----------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, choices=list(MODELS),
                 help="gradient shapes (default gpt120m; --quick: tiny)")
  p.add_argument("--layouts", default="fsdp", help="comma list of: " + ", ".join(LAYOUTS))
  p.add_argument("--dtypes", default="f32", help="comma list of: " + ", ".join(DTYPES))
  p.add_argument("--regimes", default="clip", help="comma list of: " + ", ".join(REGIMES))
  p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
  p.add_argument("--andrea-impl", default=None, choices=("auto", "ffi"),
                 help="impl= of the andrea and single rows (default: auto on a GPU, where it "
                      "is the CUDA custom call; ffi elsewhere, the CPU handler, since auto is "
                      "pure JAX there)")
  p.add_argument("--reps", type=int, default=10, help="K, clips per jitted call (andrea, single)")
  p.add_argument("--optax-reps", type=int, default=4,
                 help="K for optax (its compile time grows with K)")
  p.add_argument("--jax-reps", type=int, default=2,
                 help="K for sharded_clip_tree(impl='jax') (its compile time grows with K)")
  p.add_argument("--iters", type=int, default=10, help="jitted calls per timed round")
  p.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported")
  p.add_argument("--max-seconds", type=float, default=150,
                 help="start no new timed case after this many seconds (0: no limit)")
  p.add_argument("--no-profile", action="store_true",
                 help="skip the profiled round that gives the GPUs' busy time (device column)")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                 "sharded-<date>.json; with --quick, no file unless --out is given)")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few repetitions: a smoke test that runs on a CPU")
  args = p.parse_args(argv)
  if args.quick:
    args.model = args.model or "tiny"
    args.reps, args.optax_reps, args.jax_reps = 3, 2, 2
    args.iters, args.repeats, args.max_seconds = 2, 2, 0
  args.model = args.model or "gpt120m"
  args.layouts = choices(p, "--layouts", args.layouts, LAYOUTS)
  args.dtypes = choices(p, "--dtypes", args.dtypes, DTYPES)
  args.regimes = choices(p, "--regimes", args.regimes, REGIMES)
  args.impls = choices(p, "--impls", args.impls, IMPLS)
  return args


def pick_andrea_impl(requested, mesh):
  """(impl, note): the impl= of the andrea and single rows, and why, if it is not the default.

  The default is "auto" on a GPU (the CUDA custom call) and "ffi" elsewhere (the CPU handler;
  "auto" is pure JAX there). Unless --andrea-impl names one, each candidate must first lower
  sharded_clip_tree on a leaf split over the mesh; the first that does is used.
  """
  if requested:
    return requested, ""
  gpu = jax.default_backend() == "gpu"
  candidates = ["auto", "ffi"] if gpu else ["ffi", "auto"]
  n = mesh.devices.size
  probe = jax.device_put(jnp.ones((2 * n, 4), F32), NamedSharding(mesh, P(AXIS)))
  failures = []
  for impl in candidates:
    try:
      jax.jit(lambda t: clipjax.sharded_clip_tree(
          t, 1.0, mesh=mesh, specs=P(AXIS), impl=impl).updates).lower(probe).compile()
    except Exception as e:  # noqa: BLE001 - reported on stdout and in the JSON
      failures.append(f'impl="{impl}" fails on a leaf sharded over {n} devices: '
                      f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")
      continue
    if impl == candidates[0]:
      return impl, ""
    return impl, "; ".join(failures) + f' -- using impl="{impl}" instead'
  return "jax", "; ".join(failures) + ' -- no custom call: the andrea rows are impl="jax"'


log = bench_clip.Log()


def main(argv=None):
  args = parse_args(argv)
  n = jax.device_count()
  if n < 2:
    print(f"bench_sharded.py needs at least 2 devices; jax sees {n} ({jax.default_backend()}: "
          f"{jax.devices()}). On a CPU, start it with "
          "XLA_FLAGS=--xla_force_host_platform_device_count=2 (or 8) JAX_PLATFORMS=cpu.",
          file=sys.stderr)
    sys.exit(2)
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  andrea_impl, andrea_note = pick_andrea_impl(args.andrea_impl, mesh)
  meta = metadata(args, andrea_impl)
  meta["andrea_impl_note"] = andrea_note or None
  if andrea_note:
    log(f"WARNING: {andrea_note}")
  spec_tree = {d: gpt_grad_spec(MODELS[args.model], DTYPES[d]) for d in args.dtypes}
  first = jax.tree.leaves(spec_tree[args.dtypes[0]])
  meta.update(model=args.model, leaves=len(first),
              params=sum(math.prod(x.shape) for x in first))
  expected = EXPECTED_COUNTS.get(args.model)
  counts_note = ("" if expected is None else " (as expected)"
                 if expected == (meta["params"], meta["leaves"]) else f" (EXPECTED {expected})")
  log(f"{n} x {', '.join(meta['device_kinds'])} ({meta['backend']}): jax {meta['jax']}, "
      f"jaxlib {meta['jaxlib']}, optax {meta['optax']}, clipjax {meta['clipjax']}; "
      f'andrea/single impl="{andrea_impl}"')
  log(f"{args.model}: {meta['params'] / 1e6:.2f}M params, {meta['leaves']} leaves{counts_note}")
  out = args.out or (None if args.quick else default_out_path(meta))
  results = {"meta": meta, "checks": [], "hlo_one_clip": [], "rows": []}

  copy_bytes = COPY_BYTES if not args.quick else 1 << 24
  bw = jax_copy_bandwidth(copy_bytes, 10, args.repeats)
  meta["copy_bandwidth_GBps"] = bw / 1e9
  log(f"copy bandwidth of one device (bytes read + written): {bw / 1e9:.0f} GB/s")

  sharded = [i for i in SHARDED_IMPLS if i in args.impls]
  layouts = {}
  for dtype in args.dtypes:
    for name in args.layouts + (["single"] if "single" in args.impls else []):
      layouts[name, dtype] = Layout(name, mesh, spec_tree[dtype])

  hlos = check_all(args, layouts, sharded, andrea_impl, results)
  passed = all(c["ok"] for c in results["checks"])
  meta["passed"] = passed
  log(f"correctness: {'PASS' if passed else 'FAIL'}")
  if out:
    save(results, out, complete=False)
  time_all(args, layouts, sharded, andrea_impl, hlos, bw, results, out)

  order = {impl: i for i, impl in enumerate(IMPLS)}
  layout_order = args.layouts + ["single"]
  results["rows"].sort(key=lambda r: (args.dtypes.index(r["dtype"]),
                                      args.regimes.index(r["regime"]),
                                      layout_order.index(r["layout"]), order[r["impl"]]))
  add_ratios(results["rows"])
  print("\n" + table(results["rows"], meta))
  if meta["skipped"]:
    print("skipped (over --max-seconds): " + "; ".join(meta["skipped"]))
  failed = [c for c in results["checks"] if not c["ok"]]
  print(f"\ncorrectness: {'PASS' if passed else 'FAIL'} ({len(results['checks'])} checks"
        + (": failed " + "; ".join(f"{c['layout']} {c['dtype']} {c['what']} = {c['value']}"
                                   for c in failed) if failed else "") + ")", flush=True)
  if out:
    save(results, out, complete=True)
    log(f"wrote {out}")
  if not passed:
    sys.exit(1)


def check_all(args, layouts, sharded, andrea_impl, results):
  """Correctness, before anything is timed: one clip per impl and layout on the same tree.

  Returns {(layout, dtype, impl): HLO summary of one compiled clip}.
  """
  meta, hlos = results["meta"], {}
  for dtype in args.dtypes:
    ref_norm = f64_norm(layouts[args.layouts[0], dtype].tree())
    meta.setdefault("reference_norm", {})[dtype] = ref_norm
    to_check = [(name, sharded) for name in args.layouts]
    if "single" in args.impls:
      to_check.append(("single", ["single"]))
    for name, impls in to_check:
      layout = layouts[name, dtype]
      example = layout.tree()
      log(f"{name} {dtype}: {layout.sharded_leaves()} of {meta['leaves']} leaves sharded, "
          f"{device_bytes(example) / 1e6:.1f} MB on the fullest device")
      del example
      checks, found = run_checks(layout, dtype, impls, ref_norm, andrea_impl)
      results["checks"] += checks
      for impl, h in found.items():
        hlos[name, dtype, impl] = h
        results["hlo_one_clip"].append(dict(layout=name, dtype=dtype, impl=impl, **h))
        if impl in ("plain", "andrea", "single") and meta["platform"] == "gpu" and not h["custom_calls"]:
          log(f"  WARNING: {LABELS[impl]} (impl={andrea_impl!r}) on {name} {dtype} holds no "
              "clipjax custom call: it did not lower to the CUDA custom call")
    for c in results["checks"]:
      if c["dtype"] == dtype:
        value = ("" if c["value"] is None else f" {c['value']:.2e}"
                 + ("" if c["tol"] is None else f" (tol {c['tol']:.0e})"))
        log(f"  check {c['layout']:10s} {dtype:4s} {c['what']:36s}{value}  "
            f"{'ok' if c['ok'] else 'FAIL'}")
  return hlos


def time_all(args, layouts, sharded, andrea_impl, hlos, bw, results, out):
  """Times each (layout, dtype, regime, impl), K clips per jitted call, until --max-seconds.

  optax and impl="jax" run at fewer K (their compile time grows with K); impl="jax", the
  slowest to compile, runs after all the others.
  """
  meta = results["meta"]
  K = {"plain": args.reps, "andrea": args.reps, "single": args.reps, "optax": args.optax_reps,
       "plain_jax": args.optax_reps, "jax": args.jax_reps}
  meta["skipped"] = []
  units = [(name, dtype, regime, impl) for dtype in args.dtypes for regime in args.regimes
           for name in args.layouts for impl in SHARDED_IMPLS if impl in sharded]
  if "single" in args.impls:
    units += [("single", dtype, regime, "single") for dtype in args.dtypes
              for regime in args.regimes]
  units.sort(key=lambda u: (u[3] == "jax", args.dtypes.index(u[1]), args.regimes.index(u[2])))
  fns, norm0s = {}, {}
  for name, dtype, regime, impl in units:
    what = f"{name} {dtype} {regime} {LABELS[impl]}"
    if args.max_seconds and log.elapsed() > args.max_seconds:
      meta["skipped"].append(what)
      log(f"  over --max-seconds: skipping {what}")
      continue
    layout = layouts[name, dtype]
    if dtype not in norm0s:
      norm0s[dtype] = float(f32_norm(layout.tree()))
    norm0 = norm0s[dtype]
    key = (name, impl)
    if key not in fns:
      fns[key] = repeated_fn(clip_fn(impl, layout, andrea_impl), layout, f"clips_{impl}_{name}")
    example = layout.tree()
    _, compile_s = compile_timed(fns[key], example, layout.max_norms(regime, 1.0, K[impl]))
    nbytes = device_bytes(example)
    del example
    r = time_clip(fns[key], layout, regime, norm0, K[impl], args)
    floor_us = (3 if regime == "clip" else 1) * nbytes / bw * 1e6
    row = dict(layout=name, dtype=dtype, regime=regime, impl=impl, label=LABELS[impl],
               device_bytes=nbytes, floor_us=floor_us, compile_s=compile_s,
               sharded_leaves=layout.sharded_leaves(), hlo=hlos.get((name, dtype, impl)), **r)
    results["rows"].append(row)
    log(f"  {what:44s} in-jit {r['us_injit']:9.1f} us  device {_num(r['us_device'], 9)} us  "
        f"floor {floor_us:8.1f} us  (K={r['reps']}, compile {compile_s} s, "
        f"{collectives_text(row['hlo'])})"
        + ("" if r["regime_ok"] else "  WARNING: the regime did not hold"))
    add_ratios(results["rows"])
    if out:
      save(results, out, complete=False)


if __name__ == "__main__":
  main()
