"""Global-norm clipping on GPT-shaped gradients: clipjax against optax, torch and the memory floor.

One run measures the device copy bandwidth, derives the memory floors from it, and times
  - the clip alone: clipjax.andrea_clip (the custom call), andrea_clip(impl="jax"),
    optax.clip_by_global_norm and torch.nn.utils.clip_grad_norm_(foreach=True), with the norm
    above max_norm (every repetition clips) and below it (none does);
  - the full jitted, donated optimizer step: adamw alone, and clip then adamw for each clip.
It prints two tables and writes everything, with versions and the command line, to JSON.

    python benchmarks/bench_clip.py            # the GPU run (a few minutes on an H200)
    python benchmarks/bench_clip.py --quick    # tiny shapes: a smoke test that runs on a CPU

benchmarks/README.md says how the timing works and how to read the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
# XLA forms command buffers (CUDA graphs) from its thunks after the HLO passes, so the optimized
# HLO cannot show them; XLA's thunk dump can. The probe runs in a subprocess of this script that
# sets DUMP_DIR_ENV, so that the timed process runs without dump flags.
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
PROBE = "command_buffer_probe"
DUMP_DIR_ENV = "BENCH_CLIP_DUMP_DIR"
DUMP_DIR = os.environ.get(DUMP_DIR_ENV)
if DUMP_DIR:
  os.environ["XLA_FLAGS"] = (f"{USER_XLA_FLAGS} --xla_dump_to={DUMP_DIR} "
                             f"--xla_dump_hlo_module_re=.*{PROBE}.*").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import clipjax  # noqa: E402

F32 = jnp.float32
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
REGIMES = ("clip", "noclip")
JAX_IMPLS = ("ffi", "jax", "optax")
IMPLS = JAX_IMPLS + ("torch",)
LABELS = {"ffi": "andrea_clip", "jax": "andrea_clip(jax)", "optax": "optax", "torch": "torch"}
IN_PLACE = ("ffi",)  # the custom call writes the clipped gradients over its input
NORM_RATIO = 10.0  # ||g|| / max_norm is 10 at the start of the clipping regime, 1/10 otherwise
# max_norm shrinks by this factor every time a tree is clipped, so every repetition clips,
# with a margin above bf16's rounding (one ulp is up to 0.8%) and optax's bf16 norm (3% off).
DECAY = 0.97
# A round clips each tree at most this many times (in the clipping regime, a round of a large
# K has fewer calls), so max_norm stays far inside float32's range: 0.97^600 is 1e-8.
MAX_CLIPS_PER_TREE = 600
ADAMW = dict(learning_rate=3e-4, weight_decay=0.1)
COPY_BYTES = 1 << 30  # the bandwidth probe scales 1 GiB in place
MAX_ROTATION = 8
PER_CALL_FACTOR = 2  # a per-call round makes this many times --iters calls


@dataclasses.dataclass(frozen=True)
class GPT:
  vocab: int
  d: int
  layers: int
  ctx: int
  ff: int = 4


MODELS = {
    "gpt120m": GPT(vocab=8449, d=768, layers=12, ctx=1024),
    "gpt12m": GPT(vocab=8449, d=384, layers=6, ctx=1024),
    "tiny": GPT(vocab=97, d=32, layers=2, ctx=16),  # the --quick smoke test
    "probe": GPT(vocab=97, d=32, layers=12, ctx=16),  # gpt120m's 197 leaves, tiny: the probe
}
EXPECTED_COUNTS = {"gpt120m": (98_820_096, 197), "gpt12m": (17_529_600, 101)}


# --- gradient pytrees ------------------------------------------------------------------


def gpt_grad_spec(m: GPT, dtype) -> dict:
  """ShapeDtypeStructs of a GPT's parameters (separate q/k/v/o with biases, untied head)."""
  def a(*shape):
    return jax.ShapeDtypeStruct(shape, dtype)

  def dense(n_in, n_out):
    return {"kernel": a(n_in, n_out), "bias": a(n_out)}

  def layernorm():
    return {"scale": a(m.d), "bias": a(m.d)}

  spec = {"wte": a(m.vocab, m.d), "wpe": a(m.ctx, m.d)}
  for i in range(m.layers):
    spec[f"block_{i:02d}"] = {
        "ln1": layernorm(), "q": dense(m.d, m.d), "k": dense(m.d, m.d),
        "v": dense(m.d, m.d), "o": dense(m.d, m.d), "ln2": layernorm(),
        "mlp_in": dense(m.d, m.ff * m.d), "mlp_out": dense(m.ff * m.d, m.d)}
  spec["ln_f"] = layernorm()
  spec["lm_head"] = {"kernel": a(m.d, m.vocab)}
  return spec


@dataclasses.dataclass(frozen=True)
class Case:
  """One model at one dtype: its gradient tree's size and how many copies to rotate among."""
  model: str
  dtype: str
  params: int
  leaves: int
  grad_bytes: int
  rotation: int

  @classmethod
  def make(cls, model, dtype, rotate_bytes):
    leaves = jax.tree.leaves(gpt_grad_spec(MODELS[model], DTYPES[dtype]))
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    rotation = 1 if rotate_bytes <= 0 else min(MAX_ROTATION, math.ceil(rotate_bytes / nbytes))
    return cls(model, dtype, sum(math.prod(x.shape) for x in leaves), len(leaves), nbytes,
               rotation)

  def random_tree(self, seed, scale=1.0):
    return random_tree_fn(self.model, self.dtype)(jax.random.key(seed), scale)


@functools.lru_cache(maxsize=None)
def random_tree_fn(model, dtype):
  """jit(key, scale) -> the model's gradient tree, standard normals times `scale`.

  One random vector cut into the leaves: one random-number op to compile. One op per
  leaf (197 of them for gpt120m) took XLA about 100 s to compile on an H200.
  """
  leaves, treedef = jax.tree.flatten(gpt_grad_spec(MODELS[model], DTYPES[dtype]))
  sizes = [math.prod(x.shape) for x in leaves]
  offsets = [sum(sizes[:i]) for i in range(len(sizes))]

  @jax.jit
  def make(key, scale):
    flat = scale * jax.random.normal(key, (sum(sizes),), F32)
    return treedef.unflatten([flat[o:o + n].reshape(x.shape).astype(x.dtype)
                              for o, n, x in zip(offsets, sizes, leaves)])
  return make


@jax.jit
def f32_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree)))


def max_norm_at(regime, norm0, rep, rotation=1):
  """max_norm of repetition `rep` (0, 1, ...) of a round that starts from norm `norm0`, where
  repetition k clips tree k % rotation.

  Clipping: norm0 / 10, then 3% lower each time round the trees, so a tree clipped before
  (its norm is now that max_norm) is clipped again. Not clipping: 10 * norm0.
  """
  if regime == "clip":
    return norm0 / NORM_RATIO * DECAY**(rep // rotation)
  return norm0 * NORM_RATIO


def max_norm_schedule(regime, norm0, n, first=0, rotation=1):
  """max_norm for repetitions first ... first + n - 1, as device scalars made before the clock
  starts.

  They are weakly typed, as a literal max_norm is, so optax keeps bf16 trees in bf16.
  """
  if regime == "clip":
    return [jnp.asarray(max_norm_at(regime, norm0, first + j, rotation)) for j in range(n)]
  return [jnp.asarray(max_norm_at(regime, norm0, 0))] * n


def regime_holds(regime, trees, norm0, reps_done, rotation=1):
  """After a round: would the next repetition still clip (or still not clip)?"""
  norms = [float(f32_norm(t)) for t in trees]
  next_max = max_norm_at(regime, norm0, reps_done, rotation)
  if not all(math.isfinite(n) for n in norms):
    return False
  return all((n > next_max) if regime == "clip" else (n <= next_max) for n in norms)


# --- timing ------------------------------------------------------------------------------


WARMUP_CALLS = 2
PROFILED_CALLS = 3


def seconds_per_call(fresh, call, calls, repeats, warmup=WARMUP_CALLS, profile=True):
  """Times `calls` calls per round, `repeats` rounds, after a warm-up round.

  `fresh(state)` prepares a round (fresh data, its max_norm schedule) outside the clock;
  `call(state, c)` makes call number c and returns the new state, whose "arrays" the clock
  waits for (block_until_ready) before it stops. Returns a dict: `s` (median wall seconds per
  call), `samples`, `enqueue_fraction` (the share of a round the host spent issuing calls:
  near 1, the host, not the device, set the pace), the final `state`, and `device_s`: the GPU's
  busy seconds per call in one more round of PROFILED_CALLS calls under the profiler.
  """
  state, samples, enqueue = None, [], []
  for r in range(repeats + 1):
    state = fresh(state)
    jax.block_until_ready(state["arrays"])
    n = warmup if r == 0 else calls
    t0 = time.perf_counter()
    for c in range(n):
      state = call(state, c)
    t1 = time.perf_counter()
    jax.block_until_ready(state["arrays"])
    if r:
      samples.append((time.perf_counter() - t0) / n)
      enqueue.append((t1 - t0) / n / samples[-1])
  out = {"s": statistics.median(samples), "samples": samples,
         "enqueue_fraction": statistics.median(enqueue), "device_s": None}
  if profile and jax.default_backend() != "cpu":
    state = fresh(state)
    jax.block_until_ready(state["arrays"])
    holder = {"state": state}

    def profiled():
      for c in range(PROFILED_CALLS):
        holder["state"] = call(holder["state"], c)
      jax.block_until_ready(holder["state"]["arrays"])
    busy, kernels = gpu_busy_seconds(profiled)
    state, n = holder["state"], PROFILED_CALLS
    out["device_s"] = busy / PROFILED_CALLS if busy else None
    out["kernels_s"] = {k: v / PROFILED_CALLS for k, v in kernels.items()}
  out["state"], out["calls_since_fresh"] = state, n
  return out


def traced_gpu_planes(run, prefix):
  """Runs `run()` under the profiler and returns the GPU planes of its trace ([] if none)."""
  trace_dir = tempfile.mkdtemp(prefix=prefix)
  try:
    jax.profiler.start_trace(trace_dir)
    try:
      run()
    finally:
      jax.profiler.stop_trace()
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return []
    return [plane for plane in jax.profiler.ProfileData.from_file(files[0]).planes
            if plane.name.startswith("/device:GPU")]
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)


def busy_seconds(lines):
  """The union of the activity intervals on the stream lines among `lines` (kernels and
  copies as the GPU ran them), in seconds; idle gaps between launches do not count.
  "XLA Ops" (derived from the streams) serves if there are no stream lines; never "XLA
  Modules", whose spans include the gaps. None if there is no activity."""
  chosen = ([line for line in lines if line.name.startswith("Stream")]
            or [line for line in lines if line.name == "XLA Ops"])
  intervals = [(e.start_ns, e.start_ns + e.duration_ns) for line in chosen
               for e in line.events]
  busy, end = 0.0, -math.inf
  for start, stop in sorted(intervals):
    busy += max(0.0, stop - max(start, end))
    end = max(end, stop)
  return busy / 1e9 if intervals else None


def kernel_seconds(lines, top=8):
  """{kernel or copy name: seconds} summed over the stream lines among `lines`, the `top`
  longest (the rest summed as "(other)"): where a clip's device time goes."""
  totals: dict = {}
  for line in lines:
    if line.name.startswith("Stream"):
      for e in line.events:
        totals[e.name] = totals.get(e.name, 0.0) + e.duration_ns / 1e9
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])
  out = dict(ranked[:top])
  if len(ranked) > top:
    out["(other)"] = sum(v for _, v in ranked[top:])
  return out


def gpu_busy_seconds(run):
  """(seconds the GPU was busy while `run()` ran, {kernel: seconds}) from a profiler
  trace; (None, {}) if unknown."""
  try:
    lines = [line for plane in traced_gpu_planes(run, "bench_clip_trace_")
             for line in plane.lines]
    PROFILER_LINES.update(line.name for line in lines)
    return busy_seconds(lines), kernel_seconds(lines)
  except Exception as e:  # noqa: BLE001 - the device column is a bonus; say why it is empty
    PROFILER_LINES.add(f"error: {type(e).__name__}: {e}"[:200])
    return None, {}


PROFILER_LINES: set = set()  # line names seen on GPU planes, kept in the JSON for checking


def compile_and_inspect(jitted, *args):
  """Compiles before the timed calls (jit's cache keeps the executable); reads its HLO."""
  t0 = time.perf_counter()
  stats = hlo_stats(jitted.lower(*args).compile().as_text())
  stats["compile_s"] = round(time.perf_counter() - t0, 2)
  return stats


def hlo_stats(hlo: str) -> dict:
  """Counts in an optimized HLO module, and which computations hold the clipjax custom call.

  Older XLA versions moved runs of GPU commands into HLO computations named `command_buffer*`;
  newer ones form command buffers from the thunks after the HLO passes, which only the thunk
  dump shows (probe_command_buffers). The HLO's view is kept beside it.
  """
  computation, owners, callers, names = None, {}, {}, []
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      match = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line)
      computation = match.group(1) if match else line
      names.append(computation)
      continue
    for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
      callers.setdefault(callee, " ".join(line.split())[:240])
    if 'custom_call_target="clipjax_andrea_clip"' in line:
      owners[computation] = owners.get(computation, 0) + 1
  total = sum(owners.values())
  in_buffers = sum(n for c, n in owners.items() if "command_buffer" in (c or ""))
  evidence = "; ".join(
      f"{n} clipjax_andrea_clip custom call(s) in computation {c}"
      + (f", which is run by: {callers[c]}" if c in callers else " (the entry computation)"
         if c and c.startswith("main") else "")
      for c, n in owners.items()) or "no clipjax_andrea_clip custom call in the module"
  return {
      "fusions": len(re.findall(r"\sfusion\(", hlo)),
      "custom_calls": total,
      "copies": len(re.findall(r"\scopy(?:-start)?\(", hlo)),
      "command_buffers": sum(1 for c in names if "command_buffer" in c),
      "custom_call_in_command_buffer": total > 0 and in_buffers == total,
      "evidence": evidence,
  }


# --- the clips, and the optimizer step around them ---------------------------------------


def clip_transform(impl, andrea_impl):
  """max_norm -> the clip's optax GradientTransformation.

  max_norm is traced (an operand), so one compile serves both regimes.
  """
  if impl == "optax":
    return optax.clip_by_global_norm
  impl_arg = andrea_impl if impl == "ffi" else "jax"
  return lambda max_norm: clipjax.andrea_clip(max_norm, impl=impl_arg)


def repeated_clip(make_clip, loops=1, decay=1.0, name="repeated_clip"):
  """jit(trees, max_norms) -> trees: U = len(max_norms) clips written out, run `loops` times.

  Repetition k of a pass clips trees[k % len(trees)] with max_norms[k]; after each pass every
  max_norm is multiplied by `decay` (a Python float, so they stay weakly typed as a literal
  max_norm is). Each repetition's output is the next one's input, through an optimization
  barrier, so XLA can neither fuse one repetition's scaling into the next one's norm nor drop
  a repetition. The trees are donated: the custom call writes in place, the pure-JAX clips
  reuse buffers. With loops > 1 the passes are a fori_loop, so a call can hold thousands of
  clips (enough GPU work to hide the host's dispatch of hundreds of arrays) while XLA
  compiles only U of them.
  """
  def one_pass(trees, max_norms):
    trees = list(trees)
    for k, m in enumerate(max_norms):
      i = k % len(trees)
      tx = make_clip(m)
      trees[i] = jax.lax.optimization_barrier(tx.update(trees[i], tx.init(trees[i]))[0])
    return trees

  def run(trees, max_norms):
    if loops == 1:
      return one_pass(trees, max_norms)

    def body(_, carry):
      trees, ms = carry
      return one_pass(trees, ms), (tuple(m * decay for m in ms) if decay != 1.0 else ms)
    return jax.lax.fori_loop(0, loops, body, (list(trees), tuple(max_norms)))[0]
  run.__name__ = name
  return jax.jit(run, donate_argnums=0)


def repeated_step(make_clip, return_clipped, name="repeated_step"):
  """(jit(params, opt_state, grads, max_norms) -> the same, init): len(max_norms) steps.

  One step is optax.chain(clip, adamw) written out, so that the step can hand gradients back
  for the next one without extra memory traffic: the clipped ones where the clip wrote them in
  place (`return_clipped`, the custom call), else the input ones (the pure-JAX clips, whose
  scaling XLA may fuse into adamw's update as it would in training). `make_clip` None: adamw
  alone.
  """
  adamw = optax.adamw(**ADAMW)

  def init(params):
    return (make_clip(1.0).init(params) if make_clip else optax.EmptyState(),
            adamw.init(params))

  def run(params, opt_state, grads, max_norms):
    clip_state, adam_state = opt_state
    for m in max_norms:
      clipped = grads
      if make_clip:
        clipped, clip_state = make_clip(m).update(grads, clip_state, params)
      updates, adam_state = adamw.update(clipped, adam_state, params)
      params = optax.apply_updates(params, updates)
      grads = clipped if return_clipped else grads
      params, clip_state, adam_state, grads = jax.lax.optimization_barrier(
          (params, clip_state, adam_state, grads))
    return params, (clip_state, adam_state), grads
  run.__name__ = name
  return jax.jit(run, donate_argnums=(0, 1, 2)), init


class JaxFunctions:
  """One jitted function per clip and per step variant, shared by every shape and regime."""

  def __init__(self, andrea_impl):
    self.andrea_impl = andrea_impl
    self._clips, self._steps = {}, {}

  def clip(self, impl, loops=1, decay=1.0):
    key = (impl, loops, decay)
    if key not in self._clips:
      self._clips[key] = repeated_clip(clip_transform(impl, self.andrea_impl), loops, decay)
    return self._clips[key]

  def step(self, variant):
    if variant not in self._steps:
      make_clip = None if variant == "adamw" else clip_transform(variant, self.andrea_impl)
      self._steps[variant] = repeated_step(make_clip, variant in IN_PLACE)
    return self._steps[variant]


# --- measurements: JAX -------------------------------------------------------------------


def jax_copy_bandwidth(n_bytes, calls, repeats):
  """Bytes read + written per second by an in-place scale of one large f32 array."""
  scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
  s = jnp.asarray(1.0)

  def fresh(state):
    return state or {"arrays": jnp.ones((n_bytes // 4,), F32)}

  timing = seconds_per_call(fresh, lambda st, c: {"arrays": scale(st["arrays"], s)}, calls,
                            repeats, profile=False)
  return 2 * (n_bytes // 4) * 4 / timing["s"]


def bench_jax_clip(fns, impl, case, regime, cfg):
  """One clip in one regime: in-jit (K clips per jitted call), and one clip per call."""
  R = case.rotation
  seeds = [100 + i for i in range(R)]
  U, loops = scaled_reps({"jax": cfg.jax_reps, "optax": cfg.optax_reps}.get(impl, cfg.reps),
                         impl, case, regime, cfg)
  U = -(-U // R) * R  # a whole number of times round the trees per pass
  K = U * loops
  fn = fns.clip(impl, loops, DECAY**(U // R) if regime == "clip" else 1.0)
  injit_calls = cfg.iters
  if regime == "clip":
    injit_calls = max(PROFILED_CALLS + 1, min(injit_calls, MAX_CLIPS_PER_TREE * R // K))
  one = fns.clip(impl)
  norm0 = min(float(f32_norm(case.random_tree(s))) for s in seeds)
  example = [case.random_tree(s) for s in seeds]
  out = {"reps": K, "reps_written_out": U, "loops": loops,
         "hlo_injit": compile_and_inspect(fn, example, tuple(max_norm_schedule(regime, 1., U))),
         "hlo_call": compile_and_inspect(one, example[:1], tuple(max_norm_schedule(regime, 1., 1)))}
  del example

  def fresh_for(per_call, calls):
    # The first U max_norms of each call (the loop scales them down pass by pass).
    def fresh(state):
      del state
      return {"arrays": [case.random_tree(s) for s in seeds],
              "ms": [m for c in range(max(calls, WARMUP_CALLS, PROFILED_CALLS))
                     for m in max_norm_schedule(regime, norm0, min(per_call, U),
                                                first=c * per_call, rotation=R)]}
    return fresh

  def call_injit(state, c):
    state["arrays"] = fn(state["arrays"], tuple(state["ms"][c * U:(c + 1) * U]))
    return state

  def call_one(state, c):
    i = c % R
    state["arrays"][i] = one([state["arrays"][i]], (state["ms"][c],))[0]
    return state

  ok = True
  out["calls_per_round_injit"] = injit_calls
  for key, per_call, call, calls in (("injit", K, call_injit, injit_calls),
                                     ("call", 1, call_one, cfg.iters * PER_CALL_FACTOR)):
    timing = seconds_per_call(fresh_for(per_call, calls), call, calls, cfg.repeats,
                              profile=key == "injit" and not cfg.no_profile)
    record(out, key, timing, per_call)
    ok = ok and regime_holds(regime, timing["state"]["arrays"], norm0,
                             per_call * timing["calls_since_fresh"], R)
    del timing
  out["regime_ok"] = ok
  return out


# K, the clips per in-jit call, is what moves CALL_BYTES (3N bytes per clip clipping, N not),
# at least the K given and at most MAX_REPS[impl]: a call then holds about 12 ms of GPU work
# at an H200's bandwidth, well above the host's dispatch of the call (about 6.5 ms on an H200
# for four gpt12m bf16 trees, 404 donated arrays; with 80 clips per call, 1.2-2.1 ms of GPU
# work, the in-jit times were 3-4x the device times). At most UNROLL[impl] clips are written
# out (compile time grows faster than that number: optax at 8 on gpt120m bf16 took 26 s); a
# larger K runs them in a loop, K = passes x written out.
CALL_BYTES = 50e9
MAX_REPS = {"ffi": 2400, "optax": 128, "jax": 48}
UNROLL = {"ffi": 80, "optax": 16, "jax": 4}


def scaled_reps(K, impl, case, regime, cfg):
  """(clips written out U, passes) for one in-jit call; K = U x passes."""
  if not cfg.no_scale_reps:
    moved = case.grad_bytes * (3 if regime == "clip" else 1)
    K = max(K, min(MAX_REPS[impl], math.ceil(CALL_BYTES / moved)))
  loops = math.ceil(K / (cfg.unroll or UNROLL[impl]))
  return math.ceil(K / loops), loops


def record(out, key, timing, per_call):
  """Stores a timing as microseconds per repetition under us_<key>, samples_<key>_us, ..."""
  out[f"us_{key}"] = timing["s"] / per_call * 1e6
  out[f"samples_{key}_us"] = [t / per_call * 1e6 for t in timing["samples"]]
  out[f"enqueue_fraction_{key}"] = timing["enqueue_fraction"]
  if timing.get("kernels_s"):
    out["kernels_us"] = {k: v / per_call * 1e6 for k, v in timing["kernels_s"].items()}
  if timing["device_s"] is not None or key == "injit":
    out["us_device"] = (timing["device_s"] / per_call * 1e6 if timing["device_s"] is not None
                        else None)


def bench_jax_step(fns, variant, case, regime, cfg):
  """One donated optimizer step, one per jitted call (and K per call if --step-reps > 1)."""
  fn, init = fns.step(variant)
  K = min(cfg.step_reps, cfg.jax_reps) if variant == "jax" else cfg.step_reps
  grad_seed = 7
  norm0 = float(f32_norm(case.random_tree(grad_seed)))
  carried = {"params": case.random_tree(3, scale=0.02)}
  carried["opt_state"] = init(carried["params"])
  grads = case.random_tree(grad_seed)
  out = {w: compile_and_inspect(fn, carried["params"], carried["opt_state"], grads,
                                tuple(max_norm_schedule(regime, 1.0, n)))
         for w, n in (("hlo_injit", K), ("hlo_call", 1)) if n == 1 or K > 1}
  out.setdefault("hlo_injit", out["hlo_call"])
  out["reps"] = K
  del grads

  def fresh_for(per_call, calls):
    def fresh(state):
      if state is not None:  # parameters and moments carry on; gradients start afresh
        carried["params"], carried["opt_state"] = state["arrays"][:2]
      del state
      return {"arrays": (carried.pop("params"), carried.pop("opt_state"),
                         case.random_tree(grad_seed)),
              "ms": max_norm_schedule(regime, norm0, per_call * max(calls, WARMUP_CALLS)),
              "per_call": per_call}
    return fresh

  def call(state, c):
    n = state["per_call"]
    state["arrays"] = fn(*state["arrays"], tuple(state["ms"][c * n:(c + 1) * n]))
    return state

  ok = True
  rounds = [("call", 1, cfg.step_iters * PER_CALL_FACTOR)]
  if K > 1:
    rounds.insert(0, ("injit", K, cfg.step_iters))
  for key, per_call, calls in rounds:
    timing = seconds_per_call(fresh_for(per_call, calls), call, calls, cfg.repeats,
                              profile=key == rounds[0][0] and not cfg.no_profile)
    record(out, key, timing, per_call)
    params, opt_state, grads = timing["state"]["arrays"]
    ok = ok and regime_holds(regime, [grads], norm0, per_call * timing["calls_since_fresh"])
    ok = ok and math.isfinite(float(f32_norm(params)))
    carried["params"], carried["opt_state"] = params, opt_state
    del timing, params, opt_state, grads
  if K == 1:  # one step per call: the in-jit and per-call numbers are one measurement
    out["us_injit"] = out["us_call"]
  out["regime_ok"] = ok
  return out


# --- measurements: torch -----------------------------------------------------------------


def import_torch():
  """(torch, "") where torch sees a CUDA device, else (None, why not)."""
  try:
    import torch
  except ImportError as e:
    return None, f"torch is not importable ({e})"
  if not torch.cuda.is_available():
    return None, "torch sees no CUDA device"
  return torch, ""


def cuda_event_seconds(torch, call, calls, repeats, warmup=2):
  """Median seconds per call between CUDA events around `calls` calls."""
  for c in range(warmup):
    call(c)
  torch.cuda.synchronize()
  samples = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in range(calls):
      call(c)
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / calls)
  return statistics.median(samples), samples


def torch_copy_bandwidth(torch, n_bytes, calls, repeats):
  src = torch.randn(n_bytes // 4, device="cuda")
  dst = torch.empty_like(src)
  t, _ = cuda_event_seconds(torch, lambda c: dst.copy_(src), calls, repeats)
  return 2 * (n_bytes // 4) * 4 / t


def torch_params(torch, case, seed):
  """The case's parameters (N(0, 0.02)) with .grad set to standard normals."""
  dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
  gen = torch.Generator(device="cuda").manual_seed(seed)
  ps = []
  for x in jax.tree.leaves(gpt_grad_spec(MODELS[case.model], DTYPES[case.dtype])):
    p = torch.nn.Parameter(0.02 * torch.randn(x.shape, generator=gen, device="cuda", dtype=dtype))
    p.grad = torch.randn(x.shape, generator=gen, device="cuda", dtype=dtype)
    ps.append(p)
  return ps


def torch_grad_norm(torch, ps):
  return float(torch.linalg.vector_norm(torch.stack(
      [torch.linalg.vector_norm(p.grad.float()) for p in ps])))


def bench_torch_clip(torch, case, regime, cfg):
  """clip_grad_norm_(foreach=True): per call (CUDA events), and K calls in one CUDA graph."""
  sets = [torch_params(torch, case, seed=100 + i) for i in range(case.rotation)]
  max_norm = max_norm_at(regime, min(torch_grad_norm(torch, ps) for ps in sets), 0)

  def call(c):
    torch.nn.utils.clip_grad_norm_(sets[c % case.rotation], max_norm, foreach=True)

  t, samples = cuda_event_seconds(torch, call, cfg.iters * PER_CALL_FACTOR, cfg.repeats)
  out = {"reps": cfg.reps, "us_call": t * 1e6, "samples_call_us": [s * 1e6 for s in samples]}
  try:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
      for c in range(3):
        call(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      for c in range(cfg.reps):
        call(c)
    t, samples = cuda_event_seconds(torch, lambda c: graph.replay(), cfg.iters, cfg.repeats)
    out["us_graph"] = t / cfg.reps * 1e6
    out["samples_graph_us"] = [s / cfg.reps * 1e6 for s in samples]
    del graph
  except Exception as e:  # noqa: BLE001 - a failed capture loses only the graph number
    out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
  out["us_injit"] = out["us_device"] = out.get("us_graph")
  return out


def bench_torch_step(torch, case, regime, cfg):
  """Fused AdamW alone, and clip_grad_norm_(foreach=True) then fused AdamW, per call."""
  ps = torch_params(torch, case, seed=7)
  max_norm = max_norm_at(regime, torch_grad_norm(torch, ps), 0)
  opt = torch.optim.AdamW(ps, lr=ADAMW["learning_rate"], weight_decay=ADAMW["weight_decay"],
                          fused=True)

  def clip_then_step(c):
    torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=True)
    opt.step()

  out = {}
  for variant, call in (("adamw", lambda c: opt.step()), ("torch", clip_then_step)):
    t, samples = cuda_event_seconds(torch, call, cfg.step_iters * PER_CALL_FACTOR, cfg.repeats)
    out[variant] = {"reps": 1, "us_call": t * 1e6, "us_injit": None,
                    "samples_call_us": [s * 1e6 for s in samples]}
  return out


# --- derived numbers ---------------------------------------------------------------------


def add_ratios(clips, steps):
  """x floor, speed-ups over optax and torch, and each clip's marginal cost in the step.

  Speed-ups and the marginal use the GPU's busy time from the profiler where there is one
  (torch: its CUDA graph replay), else the in-jit wall time: a fast clip's in-jit wall time
  can be set by the host's dispatch of the call rather than by the GPU.
  """
  def same_case(rows, row, impl, framework=None):
    for r in rows:
      if ((r["model"], r["dtype"], r["regime"], r["impl"]) == (row["model"], row["dtype"],
                                                               row["regime"], impl)
          and framework in (None, r.get("framework"))):
        return r
    return None

  def gpu_time(r):
    return r.get("us_device") or r.get("us_injit")

  for row in clips:
    t = gpu_time(row)
    row["x_floor"] = row["us_injit"] / row["floor_us"] if row.get("us_injit") else None
    row["x_floor_device"] = row["us_device"] / row["floor_us"] if row.get("us_device") else None
    optax_row, torch_row = same_case(clips, row, "optax"), same_case(clips, row, "torch")
    row["speedup_vs_optax"] = gpu_time(optax_row) / t if optax_row and t else None
    row["speedup_vs_torch"] = None
    if torch_row and t:  # torch's faster form: CUDA graph replay, or eager calls
      row["speedup_vs_torch"] = min(x for x in (torch_row.get("us_graph"),
                                                torch_row["us_call"]) if x) / t
  for row in steps:
    row["marginal_us"] = row["marginal_wall_us"] = row["x_marginal_floor"] = None
    alone = same_case(steps, row, "adamw", row["framework"])
    if row["impl"] == "adamw" or alone is None:
      continue
    wall = "us_injit" if row["framework"] == "jax" else "us_call"
    row["marginal_wall_us"] = row[wall] - alone[wall]
    if row.get("us_device") and alone.get("us_device"):
      row["marginal_us"] = row["us_device"] - alone["us_device"]
    else:
      row["marginal_us"] = row["marginal_wall_us"]
    row["x_marginal_floor"] = row["marginal_us"] / row["floor_us"]


def probe_command_buffers(fns, case, cfg):
  """Does XLA run the custom call inside a command buffer (a CUDA graph)? Compile and look.

  Compiles the K-repetition clip and step with the custom call once more under probe names,
  for which XLA dumps its thunk sequence (see DUMP_DIR above), and reads where the custom
  call's thunk sits: inside a kCommandBuffer thunk, or launched on its own. The probe tree has
  gpt120m's 197 leaves at tiny sizes: dumping a full-size module takes minutes.
  """
  make_clip = clip_transform("ffi", fns.andrea_impl)
  clip_probe = repeated_clip(make_clip, name=f"{PROBE}_clip")
  step_probe, init = repeated_step(make_clip, True, name=f"{PROBE}_step")
  trees = [case.random_tree(100)]
  params = case.random_tree(3, scale=0.02)
  found = {}
  for name, fn, args in (
      ("clip", clip_probe, (trees, tuple(max_norm_schedule("clip", 1.0, cfg.reps)))),
      ("step", step_probe, (params, init(params), trees[0],
                            tuple(max_norm_schedule("clip", 1.0, cfg.step_reps))))):
    hlo = hlo_stats(fn.lower(*args).compile().as_text())
    found[name] = dict(thunk_finding(f"{PROBE}_{name}"), hlo_evidence=hlo["evidence"],
                       hlo_command_buffers=hlo["command_buffers"])
  clip_found = found["clip"]
  return {"custom_call_in_command_buffer": clip_found["in_command_buffer"],
          "evidence": clip_found["evidence"],
          "probed": f"{case.leaves} leaves ({case.dtype}), {cfg.reps} clips / "
                    f"{cfg.step_reps} steps in one jitted call", **found}


def probe_in_subprocess(args):
  """Runs probe_command_buffers in a child process that has XLA dump its thunks."""
  with tempfile.TemporaryDirectory(prefix="bench_clip_xla_dump_") as dump_dir:
    cmd = [sys.executable, os.path.abspath(__file__), "--probe-only", "--dtypes",
           args.dtypes[0], "--reps", str(args.reps), "--step-reps", str(args.step_reps)]
    done = None
    try:
      done = subprocess.run(cmd, env=dict(os.environ, **{DUMP_DIR_ENV: dump_dir}),
                            capture_output=True, text=True, timeout=600)
      return json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - the finding is then unknown, with the reason
      why = done.stderr[-500:] if done is not None else str(e)[-500:]
      return {"custom_call_in_command_buffer": None,
              "evidence": f"the probe failed ({type(e).__name__}): {why}"}


def thunk_finding(module_name):
  """Where the clipjax custom call sits in XLA's dumped thunk sequence for `module_name`."""
  dumps = sorted(glob.glob(os.path.join(DUMP_DIR or "", f"*{module_name}*thunk_sequence*.txt")))
  after = [d for d in dumps if "after_thunk_passes" in d]
  if not DUMP_DIR or not dumps:
    return {"in_command_buffer": None, "evidence": f"XLA wrote no thunk sequence for "
            f"{module_name} (backend {jax.default_backend()})", "thunk_dump": None}
  path = (after or dumps)[0]
  with open(path) as f:
    text = f.read()
  stack, inside, outside, first = [], 0, 0, None  # stack: (indent, line) of open buffers
  for line in text.splitlines():
    body = line.strip()
    if not body:
      continue
    indent = len(line) - len(line.lstrip())
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if "kCommandBuffer" in body:
      stack.append((indent, body))
      continue
    if "kCustomCall" in body or "clipjax" in body or "ffi_call" in body:
      if stack:
        inside += 1
        first = first or f"{body[:160]!r} inside {stack[-1][1][:120]!r}"
      else:
        outside += 1
        first = first or f"{body[:160]!r} at top level"
  file = os.path.basename(path)
  if inside + outside == 0:
    evidence = f"{file}: no custom-call thunk found"
  else:
    evidence = (f"{file}: {inside} custom-call thunk(s) inside a kCommandBuffer, {outside} "
                f"outside; first: {first}")
  if not after:
    evidence += " (the thunk passes changed nothing: no command buffer was formed)"
  return {"in_command_buffer": (inside > 0 and outside == 0) if inside + outside else None,
          "evidence": evidence, "thunk_dump": text[:6000]}


# --- output ------------------------------------------------------------------------------


def _num(x, width, digits=1):
  return f"{x:{width}.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def clip_table(clips, bw):
  cols = (f"{'model':8s} {'dtype':5s} {'regime':6s} {'impl':16s} {'K':>3s} {'in-jit':>8s} "
          f"{'device':>8s} {'per call':>8s} {'floor':>7s} {'x floor':>7s} {'x fl dev':>8s} "
          f"{'vs optax':>8s} {'vs torch':>8s}")
  lines = [f"CLIP ALONE, us per clip. floor: 3N bytes clipping, N not clipping, at "
           f"{bw / 1e9:.0f} GB/s", cols, "-" * len(cols)]
  for r in clips:
    lines.append(f"{r['model']:8s} {r['dtype']:5s} {r['regime']:6s} {LABELS[r['impl']]:16s} "
                 f"{r['reps']:3d} {_num(r.get('us_injit'), 8)} {_num(r.get('us_device'), 8)} "
                 f"{_num(r['us_call'], 8)} {_num(r['floor_us'], 7)} {_num(r['x_floor'], 7, 2)} "
                 f"{_num(r['x_floor_device'], 8, 2)} {_num(r['speedup_vs_optax'], 8, 2)} "
                 f"{_num(r['speedup_vs_torch'], 8, 2)}")
  lines.append("in-jit: wall time of K clips in one jitted call, per clip (torch: K calls replayed "
               "as one CUDA graph). device: the GPU's busy time per clip (profiler). vs optax, "
               "vs torch: their time over this row's, on device times where there are any.")
  return "\n".join(lines)


def step_table(steps):
  cols = (f"{'model':8s} {'dtype':5s} {'regime':6s} {'step':26s} {'in-jit':>8s} {'device':>8s} "
          f"{'per call':>8s} {'marginal':>8s} {'floor':>7s} {'x floor':>7s}")
  lines = ["FULL STEP, us per step. marginal: clip + adamw minus adamw alone (device times where "
           "there are any; torch: per call)", cols, "-" * len(cols)]
  for r in steps:
    if r["framework"] == "torch":
      name = "torch fused adamw alone" if r["impl"] == "adamw" else "torch clip + fused adamw"
    else:
      name = "adamw alone" if r["impl"] == "adamw" else f"{LABELS[r['impl']]} + adamw"
    floor = r["floor_us"] if r["impl"] != "adamw" else None
    lines.append(f"{r['model']:8s} {r['dtype']:5s} {r['regime']:6s} {name:26s} "
                 f"{_num(r.get('us_injit'), 8)} {_num(r.get('us_device'), 8)} "
                 f"{_num(r['us_call'], 8)} {_num(r['marginal_us'], 8)} {_num(floor, 7)} "
                 f"{_num(r['x_marginal_floor'], 7, 2)}")
  lines.append("floor of the marginal: the standalone clip's (3N clipping, N not); a clip fused "
               "into adamw's own pass could cost N (fused_floor_us in the JSON).")
  return "\n".join(lines)


def metadata(args, torch, andrea_impl, andrea_note, torch_note):
  dev = jax.devices()[0]
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": " ".join(["python"] + sys.argv),
      "device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
      "jax": jax.__version__, "jaxlib": package_version("jaxlib"), "optax": optax.__version__,
      "clipjax": clipjax.__version__, "clipjax_ffi_platforms": list(clipjax.ffi_platforms()),
      "torch": torch.__version__ if torch else None, "python": platform.python_version(),
      "XLA_FLAGS": USER_XLA_FLAGS,
      "settings": {k: v for k, v in vars(args).items() if k != "out"},
      "norm_over_max_norm_at_start": {"clip": NORM_RATIO, "noclip": 1 / NORM_RATIO},
      "max_norm_decay_per_rep_when_clipping": DECAY, "adamw": ADAMW,
      "andrea_impl_arg": andrea_impl, "andrea_impl_note": andrea_note,
      "torch_skipped": torch_note or None,
  }
  if torch:
    meta["torch_device"] = torch.cuda.get_device_name(0)
    meta["l2_cache_bytes"] = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
  return meta


def package_version(name):
  from importlib import metadata as md
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return None


def default_out_path(meta):
  device = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      f"{meta['date'][:10]}-{device}.json")


# --- the run -----------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default=None,
                 help="comma list of: " + ", ".join(MODELS) + " (default gpt120m,gpt12m)")
  p.add_argument("--dtypes", default="f32,bf16", help="comma list of: " + ", ".join(DTYPES))
  p.add_argument("--regimes", default="clip,noclip", help="comma list of: " + ", ".join(REGIMES))
  p.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
  p.add_argument("--reps", type=int, default=10, help="clips per jitted call (K)")
  p.add_argument("--optax-reps", type=int, default=4,
                 help="K for optax.clip_by_global_norm (its compile time grows with K)")
  p.add_argument("--jax-reps", type=int, default=2,
                 help="K for andrea_clip(impl='jax') (its compile time grows faster than K)")
  p.add_argument("--step-reps", type=int, default=1, help="optimizer steps per jitted call")
  p.add_argument("--no-scale-reps", action="store_true",
                 help="keep K as given for every case (default: K clips move CALL_BYTES, at "
                      "most MAX_REPS, so the GPU, not the host, bounds a call)")
  p.add_argument("--unroll", type=int, default=None,
                 help="clips written out per in-jit call at most; more run in a loop "
                      "(default: UNROLL, per clip)")
  p.add_argument("--iters", type=int, default=30,
                 help="jitted calls per timed round (the first call's dispatch, before the GPU "
                      "starts, is spread over them)")
  p.add_argument("--step-iters", type=int, default=10, help="the same, for the full step")
  p.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported")
  p.add_argument("--rotate-bytes", type=float, default=128e6,
                 help="rotate among enough copies of the gradient tree to touch this many bytes "
                      "before a copy is read again, so a tree that fits in L2 is still read "
                      "from HBM (0: one copy)")
  p.add_argument("--no-step", action="store_true", help="skip the full optimizer step")
  p.add_argument("--max-seconds", type=float, default=300,
                 help="start no new case after this many seconds (0: no limit); what is "
                      "skipped is listed in the output and the JSON")
  p.add_argument("--no-profile", action="store_true",
                 help="skip the profiled round that gives the GPU's busy time (device column)")
  p.add_argument("--no-probe", action="store_true",
                 help="skip the command-buffer probe (a subprocess; about 80 s on an H200)")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                 "<date>-<device>.json; with --quick, no file unless --out is given)")
  p.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few repetitions: a smoke test that runs on a CPU")
  args = p.parse_args(argv)
  if args.quick:
    args.models = args.models or "tiny"
    args.reps, args.optax_reps, args.jax_reps, args.step_reps = 3, 3, 2, 2
    args.unroll = 2  # K = 3 runs as 2 passes of 2: the loop is tested too
    args.iters, args.step_iters, args.repeats = 2, 2, 2
    args.rotate_bytes, args.max_seconds, args.no_scale_reps = 0, 0, True
  args.models = choices(p, "--models", args.models or "gpt120m,gpt12m", MODELS)
  args.dtypes = choices(p, "--dtypes", args.dtypes, DTYPES)
  args.regimes = choices(p, "--regimes", args.regimes, REGIMES)
  args.impls = choices(p, "--impls", args.impls, IMPLS)
  return args


def choices(parser, flag, value, allowed):
  items = [s.strip() for s in value.split(",") if s.strip()]
  bad = [s for s in items if s not in allowed]
  if bad or not items:
    parser.error(f"{flag}: {', '.join(bad) or 'nothing'}; choose from {', '.join(allowed)}")
  return items


def pick_andrea_impl():
  """(impl, note): the impl= that reaches the custom call here, or None if none does.

  "ffi" where clipjax accepts it; on a GPU where it refuses, "auto" (which also lowers to
  the custom call on CUDA: the HLO counts in the JSON show whether it did).
  """
  probe = {"g": jnp.ones((4,), F32)}
  try:
    jax.jit(lambda t: clipjax.clip_tree(t, 1.0, impl="ffi").updates).lower(probe)
    return "ffi", ""
  except Exception as e:  # noqa: BLE001 - reported on stdout and in the JSON
    note = f'impl="ffi" refused on backend {jax.default_backend()!r}: {str(e)[:300]}'
  if jax.default_backend() != "cpu":
    return "auto", note + ' -- timing impl="auto" instead'
  return None, note


class Log:
  """Progress lines with the seconds since start."""

  def __init__(self):
    self.t0 = time.perf_counter()

  def elapsed(self):
    return time.perf_counter() - self.t0

  def __call__(self, msg):
    print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


log = Log()


def main(argv=None):
  args = parse_args(argv)
  if args.probe_only:
    andrea_impl, _ = pick_andrea_impl()
    found = probe_command_buffers(JaxFunctions(andrea_impl), Case.make("probe", args.dtypes[0], 0),
                                  args)
    print(json.dumps(found))
    return
  torch, torch_note = import_torch() if "torch" in args.impls else (None, "")
  if torch_note:
    log(f"torch skipped: {torch_note}")
  andrea_impl, andrea_note = pick_andrea_impl() if "ffi" in args.impls else (None, "")
  if andrea_note:
    log(f"WARNING: {andrea_note}")
  impls = [i for i in IMPLS if i in args.impls and (i != "ffi" or andrea_impl)
           and (i != "torch" or torch)]
  meta = metadata(args, torch, andrea_impl, andrea_note, torch_note)
  log(f"{meta['device']} ({meta['backend']}): jax {meta['jax']}, optax {meta['optax']}, "
      f"clipjax {meta['clipjax']}, torch {meta['torch']}")
  out = args.out or (None if args.quick else default_out_path(meta))
  args.out_path = out
  results = {"meta": meta, "models": {}, "clip": [], "step": []}

  copy_bytes = COPY_BYTES if not args.quick else 1 << 24
  meta["copy_bandwidth_GBps"] = {"jax": jax_copy_bandwidth(copy_bytes, 10, args.repeats) / 1e9}
  if torch:
    meta["copy_bandwidth_GBps"]["torch"] = torch_copy_bandwidth(torch, copy_bytes, 10,
                                                                args.repeats) / 1e9
  bw = meta["copy_bandwidth_GBps"]["jax"] * 1e9  # the floors use JAX's copy
  log("copy bandwidth (bytes read + written), GB/s: " + ", ".join(
      f"{k} {v:.0f}" for k, v in meta["copy_bandwidth_GBps"].items()))

  fns = JaxFunctions(andrea_impl)
  if "ffi" in impls and args.no_probe:
    meta["command_buffer"] = {"custom_call_in_command_buffer": None,
                              "evidence": "not probed (--no-probe)"}
  elif "ffi" in impls:
    meta["command_buffer"] = probe_in_subprocess(args)
    log(f"custom call inside an XLA command buffer: "
        f"{meta['command_buffer']['custom_call_in_command_buffer']}")
  else:
    meta["command_buffer"] = {"custom_call_in_command_buffer": None,
                              "evidence": "the custom call was not timed"}

  # andrea_clip(impl="jax") compiles slowly (see --jax-reps): it runs after everything else.
  passes = [[i for i in impls if i != "jax"], [i for i in impls if i == "jax"]]
  meta["skipped"] = []
  for n_pass, pass_impls in enumerate(passes):
    for model in args.models:
      for dtype in args.dtypes:
        if not pass_impls:
          continue
        case = Case.make(model, dtype, args.rotate_bytes)
        if n_pass == 0 or model not in results["models"]:
          log_case(case)
        results["models"][model] = {"params": case.params, "leaves": case.leaves}
        for regime in args.regimes:
          if args.max_seconds and log.elapsed() > args.max_seconds:
            meta["skipped"].append(f"{model} {dtype} {regime}: {', '.join(pass_impls)}")
            log(f"  over --max-seconds: skipping {meta['skipped'][-1]}")
            continue
          run_case(case, regime, pass_impls, n_pass == 0, fns, torch, bw, results, args)
          add_ratios(results["clip"], results["step"])
          if out:
            save(results, out, complete=False)

  for rows in (results["clip"], results["step"]):
    rows.sort(key=row_order(args))
  add_ratios(results["clip"], results["step"])
  print("\n" + clip_table(results["clip"], bw))
  if results["step"]:
    print("\n" + step_table(results["step"]))
  cb = meta["command_buffer"]
  print(f"\ncustom call inside an XLA command buffer: {cb['custom_call_in_command_buffer']}"
        f" ({cb['evidence']})", flush=True)
  if meta["skipped"]:
    print("skipped (over --max-seconds): " + "; ".join(meta["skipped"]))
  meta["profiler_gpu_lines"] = sorted(PROFILER_LINES)
  if out:
    save(results, out, complete=True)
    log(f"wrote {out}")


def run_case(case, regime, impls, with_adamw, fns, torch, bw, results, args):
  """Times the clips `impls` alone, then in the optimizer step, for one case and regime."""
  floors = {"clip": 3 * case.grad_bytes / bw * 1e6, "noclip": case.grad_bytes / bw * 1e6}
  base = dict(dataclasses.asdict(case), regime=regime, floor_us=floors[regime])
  for impl in impls:
    t0 = log.elapsed()
    if impl == "torch":
      r = bench_torch_clip(torch, case, regime, args)
      log(f"  clip {regime:6s} {'torch':16s} graph  {_num(r.get('us_graph'), 9)} us  "
          f"per call {r['us_call']:9.1f} us")
    else:
      r = bench_jax_clip(fns, impl, case, regime, args)
      log(f"  clip {regime:6s} {LABELS[impl]:16s} in-jit {r['us_injit']:9.1f} us  device "
          f"{_num(r.get('us_device'), 9)} us  per call {r['us_call']:9.1f} us  "
          f"floor {floors[regime]:7.1f} us  "
          f"(K={r['reps']}" + (f" = {r['loops']} x {r['reps_written_out']}"
                               if r.get("loops", 1) > 1 else "")
          + f", compile {r['hlo_injit']['compile_s']} s, "
          f"case {log.elapsed() - t0:.0f} s)"
          + ("" if r["regime_ok"] else "  WARNING: the regime did not hold"))
      log_kernels(r)
    results["clip"].append(dict(base, table="clip", impl=impl,
                                framework="torch" if impl == "torch" else "jax", **r))
    save_partial(results, args)
  if args.no_step:
    return
  step_base = dict(base, table="step", fused_floor_us=floors["noclip"])
  for variant in (["adamw"] if with_adamw else []) + [i for i in impls if i != "torch"]:
    t0 = log.elapsed()
    r = bench_jax_step(fns, variant, case, regime, args)
    results["step"].append(dict(step_base, impl=variant, framework="jax", **r))
    save_partial(results, args)
    log(f"  step {regime:6s} {LABELS.get(variant, variant):16s} in-jit "
        f"{r['us_injit']:9.1f} us  device {_num(r.get('us_device'), 9)} us  "
        f"per call {r['us_call']:9.1f} us  "
        f"(K={r['reps']}, compile {r['hlo_injit']['compile_s']} s, "
        f"case {log.elapsed() - t0:.0f} s)"
        + ("" if r["regime_ok"] else "  WARNING: the regime did not hold"))
  if "torch" in impls:
    for variant, r in bench_torch_step(torch, case, regime, args).items():
      results["step"].append(dict(step_base, impl=variant, framework="torch", **r))
      save_partial(results, args)
      log(f"  step {regime:6s} torch {variant:10s} per call {r['us_call']:9.1f} us")


def log_kernels(r, top=4):
  """The kernels (and copies) a clip's device time went to, per clip, longest first. Their
  spans may overlap: clipjax's final and scale kernels start early (on sm_90) and wait on the
  device for the kernel before them, and that wait is part of their span."""
  kernels = r.get("kernels_us") or {}
  if kernels:
    log("      kernel spans per clip: " + ", ".join(
        f"{short_kernel_name(name)} {us:.1f} us" for name, us in list(kernels.items())[:top]))


def short_kernel_name(name):
  """clipjax's kernel name (k_...) out of a demangled signature; else the first 48 characters."""
  found = re.search(r"\bk_\w+", name)
  return found[0] if found else name[:48]


def save_partial(results, args):
  """Writes what is measured so far, so that a run stopped from outside still leaves JSON."""
  if getattr(args, "out_path", None):
    save(results, args.out_path, complete=False)


def log_case(case):
  expected = EXPECTED_COUNTS.get(case.model)
  check = ("" if expected is None else " (as expected)"
           if expected == (case.params, case.leaves) else f" (EXPECTED {expected})")
  log(f"{case.model} {case.dtype}: {case.params / 1e6:.2f}M params, {case.leaves} leaves"
      f"{check}, {case.grad_bytes / 1e6:.1f} MB; rotating {case.rotation} tree(s)")


def row_order(args):
  order = {"adamw": -1, **{impl: i for i, impl in enumerate(IMPLS)}}
  return lambda r: (args.models.index(r["model"]), args.dtypes.index(r["dtype"]),
                    args.regimes.index(r["regime"]), r.get("framework") == "torch",
                    order[r["impl"]])


def save(results, path, complete):
  results["meta"]["complete"] = complete
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
