"""What the devices did: busy time from a profiler trace, and summaries of compiled programs
(their HLO, their memory, and where XLA put the clipjax custom call among its thunks)."""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import tempfile
import time

import jax

PROFILER_LINES: set = set()  # line names seen on GPU planes, kept in the JSON for checking
CUSTOM_CALL = 'custom_call_target="clipjax_andrea_'  # either call: the norms, the scale
COLLECTIVE_RE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                           r"collective-permute|collective-broadcast)(-start)?\(")
PROBE = "command_buffer_probe"  # the name of the modules whose thunks XLA dumps


# --- busy time from a profiler trace ---------------------------------------------------


def device_seconds(run):
  """({GPU plane: seconds busy}, {kernel or copy: seconds}) while `run()` ran, from a
  profiler trace; ({}, {}) where there is no GPU or the trace failed (the reason is kept in
  PROFILER_LINES)."""
  try:
    planes = traced_gpu_planes(run)
  except Exception as e:  # noqa: BLE001 - the device column is a bonus; say why it is empty
    PROFILER_LINES.add(f"error: {type(e).__name__}: {e}"[:200])
    return {}, {}
  busy, lines = {}, []
  for plane in planes:
    PROFILER_LINES.update(line.name for line in plane.lines)
    seconds = busy_seconds(list(plane.lines))
    if seconds is not None:
      busy[plane.name] = seconds
    lines += list(plane.lines)
  return busy, kernel_seconds(lines)


def traced_gpu_planes(run):
  """Runs `run()` under the profiler and returns the GPU planes of its trace ([] if none)."""
  return [plane for plane in traced_planes(run) if plane.name.startswith("/device:GPU")]


def traced_planes(run, keep_dir=None):
  """Runs `run()` under the profiler and returns every plane of its trace ([] if none); the
  trace files stay in `keep_dir` when one is given."""
  trace_dir = keep_dir or tempfile.mkdtemp(prefix="benchlib_trace_")
  try:
    jax.profiler.start_trace(trace_dir)
    try:
      run()
    finally:
      jax.profiler.stop_trace()
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return []
    return list(jax.profiler.ProfileData.from_file(files[0]).planes)
  finally:
    if keep_dir is None:
      shutil.rmtree(trace_dir, ignore_errors=True)


def host_seconds(planes, top=25):
  """{host event name: seconds} summed over the host planes' threads, the `top` longest:
  where the host's time went (events nest, so a caller's time includes its callees')."""
  totals: dict = {}
  for plane in planes:
    if not plane.name.startswith("/host"):
      continue
    for line in plane.lines:
      for e in line.events:
        totals[e.name] = totals.get(e.name, 0.0) + e.duration_ns / 1e9
  return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


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
  longest (the rest summed as "(other)"): where the device time went."""
  totals = stream_totals(lines, lambda name: name)
  ranked = sorted(((k, seconds) for k, (_, seconds) in totals.items()), key=lambda kv: -kv[1])
  out = dict(ranked[:top])
  if len(ranked) > top:
    out["(other)"] = sum(v for _, v in ranked[top:])
  return out


def instruction_shapes(hlo: str) -> dict:
  """{instruction name: the shape it writes, without layouts} of an optimized HLO module
  (a tuple shape shortened to its first two parts): what `kernel_classes` names kernels by."""
  shapes = {}
  for body in _computations(hlo):
    for name, (shape, _, _, _) in body.items():
      if shape.startswith("("):
        parts = re.findall(r"\w+\[[\d,]*\]", shape)
        shape = "(" + ", ".join(parts[:2]) + (", ...)" if len(parts) > 2 else ")")
      shapes[name] = shape
  return shapes


def kernel_classes(lines, shapes):
  """{kernel class: [kernels, seconds]} over the stream lines among `lines`, a class being
  the kind of fusion XLA made (its name without the numbering: loop_convert_fusion,
  wrapped_slice, gemm_fusion_dot, ...) and the shape it writes (from `instruction_shapes` of
  the compiled module); a kernel the module does not name (a library's, clipjax's) is its
  own class (`short_kernel_name`). Two steps' classes side by side say which kernels one
  step adds to the other, and what they write."""
  def kernel_class(name):
    shape = shapes.get(re.sub(r"_(\d+)$", r".\1", name), shapes.get(name))
    stem = re.sub(r"_\d+$", "", name)
    return f"{stem} {shape}" if shape else short_kernel_name(name)

  return stream_totals(lines, kernel_class)


def stream_totals(lines, key):
  """{key(kernel or copy name): [kernels, seconds]} over the stream lines among `lines`."""
  out: dict = {}
  for line in lines:
    if line.name.startswith("Stream"):
      for e in line.events:
        count_seconds = out.setdefault(key(e.name), [0, 0.0])
        count_seconds[0] += 1
        count_seconds[1] += e.duration_ns / 1e9
  return out


def kernel_deltas(got, ref, top):
  """The `top` kernel classes whose time differs most between two steps' `kernel_classes`
  given per step ({class: [kernels, us]}, `got` against `ref`): [(class, kernels in ref,
  kernels in got, us more than ref)].

  Classes that differ only in the dtypes they write are compared as one (the same kernels,
  where a convert moved from one fusion to another), under `got`'s name for them."""
  merged: dict = {}
  for sign, classes in ((-1, ref), (1, got)):
    for name, (kernels, us) in classes.items():
      entry = merged.setdefault(re.sub(r"\b[a-z]\w*\[", "[", name), [name, 0, 0, 0.0])
      entry[0] = name if sign > 0 else entry[0]
      entry[1 if sign < 0 else 2] += kernels
      entry[3] += sign * us
  return sorted(map(tuple, merged.values()), key=lambda d: -abs(d[3]))[:top]


def short_kernel_name(name):
  """clipjax's kernel name (k_...) out of a demangled signature; else its first 48
  characters."""
  found = re.search(r"\bk_\w+", name)
  return found[0] if found else name[:48]


# --- compiled programs -------------------------------------------------------------------


def compile_summary(jitted, *args):
  """Compiles `jitted` for `args` (jit's cache keeps the executable for the timed calls) and
  summarises it: hlo_summary, compile_s, and the per-device memory XLA planned."""
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  out = hlo_summary(compiled.as_text())
  out["compile_s"] = round(time.perf_counter() - t0, 2)
  out["memory"] = memory_summary(compiled)
  return out


def hlo_summary(hlo: str) -> dict:
  """Counts in an optimized HLO module: fusions, clipjax custom calls and their operands by
  producer (`call_operands`), copies, and the collectives (count per op, largest buffer in
  elements)."""
  counts, largest = {}, 0
  for line in hlo.splitlines():
    m = COLLECTIVE_RE.search(line)
    if m:
      counts[m.group(2)] = counts.get(m.group(2), 0) + 1
      sizes = [math.prod(int(d) for d in dims.split(",") if d)
               for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]
      largest = max(largest, max(sizes, default=1))
  return {"fusions": len(re.findall(r"\sfusion\(", hlo)),
          "custom_calls": hlo.count(CUSTOM_CALL), "call_operands": call_operands(hlo),
          "copies": len(re.findall(r"\scopy(?:-start)?\(", hlo)),
          "collectives": counts, "collective_max_elements": largest}


def call_operands(hlo: str) -> dict:
  """{producer class: operands} of the clipjax custom calls in an optimized HLO module: the
  kind of fusion or instruction that wrote each operand the calls read, looked through
  bitcasts and tuple elements (gemm_fusion_dot, wrapped_slice, parameter, ...), with the
  operand's shape without layouts.

  A custom call reads its operands from memory, so each is an array that XLA writes out;
  where the optimizer alone reads the same value inside its own kernels (a slice of a
  merged matmul, a convert, the sum of a split matmul), that write is the call's. Set
  beside the kernel classes (`kernel_classes`) of the step without the call, the classes
  here say which of the call's operands XLA wrote for it."""
  out: dict = {}
  for body in _computations(hlo):
    for call, (_, _, operands, line) in body.items():
      target = re.search(r'custom_call_target="(clipjax_\w+)"', line)
      # The leaves follow max_norm in the clip call, the factors and actions in the scale call.
      for operand in operands[_LEAVES_FROM.get(target and target[1], len(operands)):]:
        producer = operand
        while producer in body and body[producer][1] in _VIEWS:
          producer = body[producer][2][0]
        if producer not in body:
          continue
        stem = re.sub(r"(\.\d+|\.clone)+$", "", producer)
        kind = stem if body[producer][1] == "fusion" else body[producer][1]
        key = f"{kind} {body[operand][0]}"
        out[key] = out.get(key, 0) + 1
  return out


_LEAVES_FROM = {"clipjax_andrea_clip": 1, "clipjax_andrea_scale": 2}
_VIEWS = ("bitcast", "get-tuple-element")
_INSTRUCTION_RE = re.compile(r"^\s+(?:ROOT )?%?([\w.-]+) = (\([^()]*\)|\S+) ([\w-]+)\(")


def _computations(hlo: str):
  """Each computation of an HLO module's text as {instruction: (shape without layouts,
  opcode, operand names, line)}."""
  body: dict = {}
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      if body:
        yield body
      body = {}
      continue
    m = _INSTRUCTION_RE.match(line)
    if not m:
      continue
    start, depth = m.end(), 1
    for end in range(start, len(line)):
      depth += {"(": 1, ")": -1}.get(line[end], 0)
      if depth == 0:
        break
    args = re.sub(r"/\*[^*]*\*/", "", line[start:end])
    operands = [a.strip().lstrip("%") for a in args.split(",") if a.strip().startswith("%")]
    body[m.group(1)] = (re.sub(r"\{[^}]*\}", "", m.group(2)), m.group(3), operands, line)
  if body:
    yield body


def memory_summary(compiled):
  """Bytes per device of a compiled program (compiled.memory_analysis()): its peak, and the
  arguments, outputs, outputs aliased to donated arguments, and temporaries it counts.
  None where the backend does not say."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return {"peak_bytes": getattr(stats, "peak_memory_in_bytes", None),
          "argument_bytes": stats.argument_size_in_bytes,
          "output_bytes": stats.output_size_in_bytes,
          "alias_bytes": stats.alias_size_in_bytes,
          "temp_bytes": stats.temp_size_in_bytes}


# --- command buffers ---------------------------------------------------------------------


def thunk_dump_flags(dump_dir):
  """XLA_FLAGS that have XLA dump the thunk sequences of the probe's modules."""
  return f"--xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*{PROBE}.*"


def thunk_finding(dump_dir, module_name):
  """Where the clipjax custom call sits in XLA's dumped thunk sequence for `module_name`:
  inside a kCommandBuffer thunk (a CUDA graph), or launched on its own.

  XLA forms command buffers from its thunks after the HLO passes, so the optimized HLO
  cannot show them; the thunk dump can.
  """
  dumps = sorted(glob.glob(os.path.join(dump_dir, f"*{module_name}*thunk_sequence*.txt")))
  after = [d for d in dumps if "after_thunk_passes" in d]
  if not dumps:
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
    elif "kCustomCall" in body or "clipjax" in body or "ffi_call" in body:
      inside, outside = (inside + 1, outside) if stack else (inside, outside + 1)
      first = first or (f"{body[:160]!r} inside {stack[-1][1][:120]!r}" if stack
                        else f"{body[:160]!r} at top level")
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
