"""What a benchmark prints: fixed-width tables (record.py writes its JSON)."""

from __future__ import annotations


def num(x, width, digits=1):
  return f"{x:{width}.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def render(title, columns, rows, footer):
  """A fixed-width table: `columns` is a list of (header, width, row -> value), a value
  being a number (one decimal), a (number, digits) pair, or text."""
  def cell(value, width):
    if isinstance(value, tuple):
      return num(value[0], width, value[1])
    if value is None or isinstance(value, (int, float)):
      return num(value, width)
    return value

  def pad(text, width):
    return f"{text:<{-width}s}" if width < 0 else f"{text:>{width}s}"

  header = " ".join(pad(h, w) for h, w, _ in columns)
  lines = [title, header, "-" * len(header)]
  for r in rows:
    lines.append(" ".join(pad(cell(get(r), abs(w)), w) for _, w, get in columns))
  lines.append(footer)
  return "\n".join(lines)


def clip_table(rows, bw):
  columns = [("model", -8, lambda r: r["model"]), ("dtype", -5, lambda r: r["dtype"]),
             ("regime", -6, lambda r: r["regime"]), ("impl", -16, lambda r: r["label"]),
             ("K", 5, lambda r: (r["reps"], 0)), ("in-jit", 8, lambda r: r.get("us_injit")),
             ("device", 8, lambda r: r.get("us_device")), ("per call", 8, lambda r: r["us_call"]),
             ("floor", 7, lambda r: r["floor_us"]), ("x floor", 7, lambda r: (r["x_floor"], 2)),
             ("x fl dev", 8, lambda r: (r["x_floor_device"], 2)),
             ("vs optax", 8, lambda r: (r["speedup_vs_optax"], 2)),
             ("vs torch", 8, lambda r: (r["speedup_vs_torch"], 2))]
  return render(
      f"CLIP ALONE, us per clip. floor: 3N bytes clipping, N not clipping, at "
      f"{bw / 1e9:.0f} GB/s", columns, rows,
      "in-jit: wall time of K clips in one jitted call, per clip (torch: K calls replayed as "
      "one CUDA graph). device: the GPU's busy time per clip (profiler). vs optax, vs torch: "
      "their time over this row's, on device times where there are any.")


def sharded_clip_table(rows, meta):
  columns = [("layout", -10, lambda r: r["layout"]), ("dtype", -5, lambda r: r["dtype"]),
             ("regime", -6, lambda r: r["regime"]), ("impl", -24, lambda r: r["label"]),
             ("K", 3, lambda r: (r["reps"], 0)), ("in-jit", 8, lambda r: r["us_injit"]),
             ("device", 8, lambda r: r.get("us_device")), ("floor", 7, lambda r: r["floor_us"]),
             ("x floor", 7, lambda r: (r["x_floor"], 2)),
             ("vs optax", 8, lambda r: (r["speedup_vs_optax"], 2)),
             ("vs 1 dev", 8, lambda r: (r["speedup_vs_single"], 2)),
             ("cc", 3, lambda r: ((r["hlo"] or {}).get("custom_calls"), 0)),
             ("collectives", -20, lambda r: collectives_text(r["hlo"]))]
  return render(
      f"SHARDED CLIP, us per clip: {sharded_title(meta)}; floor: 3 x one device's bytes "
      f"(1 x not clipping) at {meta['copy_bandwidth_GBps']:.0f} GB/s; the custom call with "
      f"impl=\"{meta['andrea_impl_arg']}\"", columns, rows,
      "in-jit: wall time of K clips in one jitted call, per clip; device: the busiest "
      "device's busy time per clip (profiler). x floor, vs optax (optax's time / this row's, "
      "same layout), vs 1 dev (the one-device clip's time / this row's) use device times "
      "where there are any. cc: clipjax custom calls in one compiled clip; collectives in "
      "one compiled clip (AR all-reduce, AG all-gather, ...; max: the largest buffer in "
      "elements).")


def train_step_table(rows, meta):
  columns = [("dtype", -5, lambda r: r["dtype"]), ("step", -34, lambda r: r["label"]),
             ("in-jit", 9, lambda r: r["us_injit"]),
             ("device", 9, lambda r: r.get("us_device")),
             ("per device", -19, lambda r: per_device_text(r.get("device_us_per_device"))),
             ("peak MB/dev", 11, lambda r: mb(r["memory"], "peak_bytes")),
             ("temp MB/dev", 11, lambda r: mb(r["memory"], "temp_bytes")),
             ("vs optax", 8, lambda r: (r["speedup_vs_optax"], 2))]
  return render(
      f"FSDP TRAINING STEP, us per step: {sharded_title(meta)}; params, optimizer state and "
      f"gradients donated; every step clips", columns, rows,
      "in-jit: wall time per step, one step per jitted call; device: the busiest device's "
      "busy time per step (profiler), per device: each device's; peak, temp: per device, "
      "from compiled.memory_analysis(); vs optax: optax's chain's device time (else in-jit) "
      "over this row's.")


def sharded_title(meta):
  return (f"{meta['model']} ({meta['params'] / 1e6:.2f}M params, {meta['leaves']} leaves) "
          f"over {meta['device_count']} x {meta['device_kinds'][0]}")


def collectives_text(h):
  if h is None:
    return "-"
  short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
           "collective-permute": "CP", "collective-broadcast": "CB"}
  if not h["collectives"]:
    return "none"
  ops = " ".join(f"{n} {short.get(op, op)}" for op, n in sorted(h["collectives"].items()))
  return f"{ops}, max {h['collective_max_elements']}"


def per_device_text(per_device):
  if not per_device:
    return "-"
  return " / ".join(f"{v:.1f}" for _, v in sorted(per_device.items()))


def mb(memory, key):
  value = (memory or {}).get(key)
  return None if value is None else value / 1e6
