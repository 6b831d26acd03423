"""Make the documentation's tables and figures from the measurement records.

Each record in `docs/results/` is one run of a benchmark or experiment: its command, date,
device, versions, the commit whose code ran, and its tables of numbers. A record as a
benchmark writes it (`benchmarks/benchlib/record.py`: its run's `meta` and its `rows`) is
read as one of these (`from_benchmark`), so it can be copied here as it is. This writes,
into `docs/_generated/` (ignored by git), one Markdown include per record (its tables and a
line saying where they come from) and the figures the pages show. Sphinx runs it from
`conf.py`; `python docs/make_results.py` does the same by hand.
"""

import json
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(DOCS, "results")
GENERATED = os.path.join(DOCS, "_generated")
REQUIRED = ("title", "command", "date", "device", "versions", "commit", "tables")


# The versions a benchmark's record names, in the order the docs show them.
BENCHMARK_VERSIONS = ("python", "jax", "jaxlib", "optax", "clipjax")


def from_benchmark(raw, name, path):
  """A benchmark's record (`{"meta": ..., "rows": [...], ...}`) in the docs' fields: each
  top-level list of dicts a table (`rows` is "main"), its columns the keys in the order
  they first appear. An unfinished run (`meta["complete"]` false) is refused."""
  meta = raw["meta"]
  if not meta.get("complete", False):
    raise ValueError(f"{path}: the run did not finish (meta.complete is not true)")
  tables = []
  for key, value in raw.items():
    if not (isinstance(value, list) and value and all(isinstance(r, dict) for r in value)):
      continue
    columns = list(dict.fromkeys(column for row in value for column in row))
    tables.append({"name": "main" if key == "rows" else key, "columns": columns,
                   "rows": [[row.get(column) for column in columns] for row in value]})
  count, kinds = meta.get("device_count"), meta.get("device_kinds")
  return {
      "title": raw.get("title", name),
      "command": meta.get("command"),
      "date": (meta.get("date") or "")[:10] or None,
      "device": f"{count}x {', '.join(kinds)}" if count and kinds else None,
      "versions": {k: meta[k] for k in BENCHMARK_VERSIONS if meta.get(k)},
      "commit": meta.get("git_commit"),
      "tables": tables,
  }


def load_records(results_dir=RESULTS):
  """Every record, by name (its file name without `.json`), each checked for its fields."""
  records = {}
  for file_name in sorted(os.listdir(results_dir)):
    if not file_name.endswith(".json"):
      continue
    path = os.path.join(results_dir, file_name)
    name = file_name[:-len(".json")]
    with open(path) as f:
      record = json.load(f)
    if "meta" in record:
      record = from_benchmark(record, name, path)
    missing = [key for key in REQUIRED if record.get(key) is None]
    if missing:
      raise ValueError(f"{path}: the record lacks {', '.join(missing)}")
    for table in record["tables"]:
      width = len(table["columns"])
      for row in table["rows"]:
        if len(row) != width:
          raise ValueError(f"{path}: table {table['name']!r} has a row of {len(row)} cells "
                           f"for {width} columns: {row}")
    records[name] = record
  return records


def cell(value):
  """A table cell: None as a dash, large counts with thousands separators, a list as its
  cells."""
  if value is None:
    return "-"
  if isinstance(value, list):
    return ", ".join(cell(v) for v in value)
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, int):
    return f"{value:,}" if abs(value) >= 10_000 else str(value)
  if isinstance(value, float):
    return f"{value:g}"
  return str(value)


def markdown_table(columns, rows):
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def source_line(record):
  """Where a record's numbers come from: the command, and the run's device and versions."""
  commands = record["command"]
  commands = [commands] if isinstance(commands, str) else commands
  versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
  lines = ["```bash"] + commands + ["```", "",
           f"*{record['device']}; {versions}; measured {record['date']} at commit "
           f"{record['commit']}.*"]
  if record.get("notes"):
    lines[-1] = lines[-1][:-1] + " " + record["notes"] + "*"
  return "\n".join(lines)


def record_markdown(record):
  parts = []
  for table in record["tables"]:
    if table.get("caption"):
      parts.append(table["caption"])
    parts.append(markdown_table(table["columns"], table["rows"]))
  parts.append(source_line(record))
  return "\n\n".join(parts) + "\n"


def table(record, name="main"):
  """A record's table by name, as (columns, rows as dicts by column)."""
  for t in record["tables"]:
    if t["name"] == name:
      return t["columns"], [dict(zip(t["columns"], row)) for row in t["rows"]]
  raise KeyError(f"no table {name!r} in {record['title']!r}")


README_CASES = (("andrea-120m", 1, "f32"), ("andrea-120m", 4, "f32"), ("andrea-12m", 4, "f32"),
                ("andrea-12m", 16, "f32"))


def readme_table(records):
  """The README's headline table: the training step on the wall clock, from its record."""
  _, rows = table(records["train_step_h200"])
  by_case = {(r["model"], r["rows"], r["grads"]): r for r in rows}
  lines = ["| model, rows of 1024 tokens | `adamw` alone | `andrea_clip` + `adamw` "
           "| `clip_by_global_norm` + `adamw` |", "|---|---|---|---|"]
  for case in README_CASES:
    r = by_case[case]
    lines.append(f"| {case[0]}, {case[1]} | {r['adamw alone (ms)']:.2f} ms "
                 f"| **{r['andrea_clip + adamw (ms)']:.2f} ms "
                 f"({r['paired vs adamw (andrea)']:.3f}x)** "
                 f"| {r['clip_by_global_norm + adamw (ms)']:.2f} ms "
                 f"({r['paired vs adamw (optax)']:.3f}x) |")
  return "\n".join(lines)


def _subplots(columns, width):
  """A figure of `columns` axes side by side, drawn without a display."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(1, columns, figsize=(width, 3.4))


def _label(axes_titles, ticks, fontsize=10):
  """Category ticks, a title and a light grid on each of the (axes, title) pairs."""
  for ax, title in axes_titles:
    ax.set_xticks(range(len(ticks)), ticks, fontsize=fontsize)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _save(fig, path, legend_axes):
  import matplotlib.pyplot as plt
  legend_axes.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def figure_recipes(records, path):
  """Largest gradient norm and final loss of each recipe at both sizes."""
  fig, (ax_norm, ax_loss) = _subplots(2, 9)
  width = 0.38
  for i, (name, label) in enumerate((("recipes_12m_h200", "andrea-12m"),
                                     ("recipes_120m_h200", "andrea-120m"))):
    _, rows = table(records[name])
    xs = [j + (i - 0.5) * width for j in range(len(rows))]
    ax_norm.bar(xs, [r["largest norm"] for r in rows], width, label=label)
    ax_loss.bar(xs, [r["last-10 loss"] for r in rows], width, label=label)
    ticks = [r["run"] for r in rows]
  _label(((ax_norm, "largest pre-clip gradient norm"),
          (ax_loss, "loss, mean of the last 10 steps")), ticks)
  ax_norm.set_yscale("log")
  ax_norm.axhline(1.0, color="k", lw=0.8, ls=":")
  _save(fig, path, ax_norm)


def figure_lr_sweep(records, path):
  """Lowest 50-step mean loss against the peak learning rate, each seed a point."""
  _, rows = table(records["lr_sweep_120m_h200"])
  fig, ax = _subplots(1, 5.2)
  for recipe, marker in (("v1", "o"), ("v2", "s")):
    mine = [r for r in rows if r["recipe"] == recipe]
    ax.scatter([r["peak lr"] for r in mine], [r["lowest 50-step mean loss"] for r in mine],
               marker=marker, label=f"{recipe}", alpha=0.8)
    lrs = sorted({r["peak lr"] for r in mine})
    means = [sum(r["lowest 50-step mean loss"] for r in mine if r["peak lr"] == lr) /
             sum(1 for r in mine if r["peak lr"] == lr) for lr in lrs]
    ax.plot(lrs, means, lw=1)
  ax.set_xscale("log")
  ax.set_xlabel("peak learning rate")
  ax.set_ylabel("lowest 50-step mean loss")
  ax.set_title("andrea-120m, 800 steps, seeds 0-2", fontsize=10)
  ax.grid(alpha=0.3)
  _save(fig, path, ax)


def figure_fallback_vs_cuda(records, path):
  """The training step without a clip and with each, and each clip alone."""
  _, rows = table(records["fallback_vs_cuda_timing_h200"])
  configs = sorted({r["config"] for r in rows}, reverse=True)
  fig, (ax_step, ax_clip) = _subplots(2, 9)
  width = 0.27
  for j, config in enumerate(configs):
    by_clip = {r["clip"]: r for r in rows if r["config"] == config}
    base = by_clip["jax"]["step without clip (ms)"]
    steps = [base, by_clip["jax"]["step with clip (ms)"], by_clip["ffi"]["step with clip (ms)"]]
    for k, (value, label) in enumerate(zip(steps, ("no clip", "impl=jax", "impl=ffi (CUDA)"))):
      ax_step.bar(j + (k - 1) * width, value, width, color=f"C{k}", label=label if j == 0 else None)
    for k, clip in enumerate(("jax", "ffi")):
      ax_clip.bar(j + (k - 0.5) * width, by_clip[clip]["clip alone, scaling (ms)"], width,
                  color=f"C{k + 1}")
  _label(((ax_step, "training step (ms)"), (ax_clip, "the clip alone, scaling (ms)")), configs,
         fontsize=8)
  _save(fig, path, ax_step)


def figure_clip_alone(records, path):
  """The clip alone on one GPU: the custom call and optax against the memory floor."""
  _, rows = table(records["clip_alone_h200"])
  labels = [f"{r['tree']}\n{r['dtype, regime']}" for r in rows]
  fig, ax = _subplots(1, 9)
  width = 0.27
  for k, (column, label) in enumerate((("floor", "memory floor"),
                                       ("andrea_clip (device)", "andrea_clip"),
                                       ("optax (device)", "optax.clip_by_global_norm"))):
    ax.bar([j + (k - 1) * width for j in range(len(rows))], [r[column] for r in rows], width,
           label=label)
  _label(((ax, ""),), labels, fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel("device time per clip (us)")
  _save(fig, path, ax)


FIGURES = {
    "recipes.png": figure_recipes,
    "lr_sweep.png": figure_lr_sweep,
    "fallback_vs_cuda.png": figure_fallback_vs_cuda,
    "clip_alone.png": figure_clip_alone,
}


def main(out_dir=GENERATED, results_dir=RESULTS):
  """Write every record's include and every figure into `out_dir`; returns their paths."""
  records = load_records(results_dir)
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for name, record in records.items():
    path = os.path.join(out_dir, f"{name}.md")
    with open(path, "w") as f:
      f.write(record_markdown(record))
    written.append(path)
  for file_name, draw in FIGURES.items():
    path = os.path.join(out_dir, file_name)
    draw(records, path)
    written.append(path)
  return written


if __name__ == "__main__":
  for written_path in main(*sys.argv[1:2]):
    print(written_path)
