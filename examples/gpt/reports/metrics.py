"""The run's metrics log (metrics.jsonl), its records, and atomic writes of the run's files.

Two kinds of record: one per phase boundary (`phase_record`) and one per step
(`step_record`), written in step order.

Every file of a run is written so that a kill at any moment leaves the old file or the
new one, never a shortened one: `write_atomic` writes a temporary file beside the target
and moves it into place with `os.replace`. metrics.jsonl grows by one appended line per
record; on a resume it is first cut back to the restored checkpoint's step by such an
atomic rewrite. A line cut short by a kill mid-append can only be the last one, and is
dropped when the log is read back.
"""

import json
import os
from typing import Sequence

import numpy as np


def write_atomic(path: str, write) -> None:
  """Calls write(file) on a temporary file, then moves it to `path` in one step."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json_atomic(path: str, obj) -> None:
  write_atomic(path, lambda f: json.dump(obj, f, indent=2))


def read_records(path: str, damaged: list | None = None) -> list[dict]:
  """The records of a metrics log; a last line cut short by a kill is dropped.

  Any other line that is not a record (not a JSON object with a kind and a step) is
  appended to `damaged` as (line number, text) where a list is given; otherwise it is a
  ValueError naming the file and line.
  """
  if not os.path.exists(path):
    return []
  with open(path, errors="replace") as f:
    lines = [(n, line) for n, line in enumerate(f.read().split("\n"), start=1) if line.strip()]
  records = []
  for i, (line_number, line) in enumerate(lines):
    try:
      record = json.loads(line)
      problem = None if isinstance(record, dict) and {"kind", "step"} <= set(record) \
          else "not a record with a kind and a step"
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break  # a kill during the last append
      problem = f"not JSON ({e})"
    if problem is None:
      records.append(record)
    elif damaged is None:
      raise ValueError(f"{path}: line {line_number} is {problem}")
    else:
      damaged.append((line_number, line))
  return records


def step_records(records: list[dict]) -> list[dict]:
  return [r for r in records if r["kind"] == "step"]


def phase_record(step: int, phase: int, length: int, names: Sequence[str], weights,
                 reward) -> dict:
  """A phase boundary: the phase's source weights and the rewards that set them (None
  for the first phase)."""
  return {"kind": "phase", "step": step, "phase": phase, "length": length,
          "weights": dict(zip(names, np.asarray(weights).tolist())),
          "reward": None if reward is None else dict(zip(names, np.asarray(reward).tolist()))}


TOP_LEAVES = 5  # a spike step's record names its leaves of the largest norms
# A step record's fields that measure the machine, not the run: two runs of the same
# settings (one of them resumed, say) differ in them and in nothing else.
MEASURED = ("tokens_per_s", "step_time_s", "device_memory_bytes")


def step_record(step: int, phase: int, names: Sequence[str], m: dict,
                tokens_per_s: float, step_time_s: float | None = None,
                device_memory_bytes: Sequence[int] | None = None,
                leaf_names: Sequence[str] = ()) -> dict:
  """A step, from the fetched metrics of the training step (train_step.py), its time
  (between the fetches of two steps' metrics) and the bytes in use on each device. A
  spike step also names its TOP_LEAVES leaves of the largest norms (`leaf_names`: the
  paths of the leaf norms, clipjax.named_leaf_norms's keys)."""
  spike = bool(m["spike"])
  top = None
  if spike and m["leaf_norms"] is not None:
    norms = np.asarray(m["leaf_norms"], np.float64)
    top = [[leaf_names[i], float(norms[i])] for i in np.argsort(-norms)[:TOP_LEAVES]]
  return {
      "kind": "step", "step": step, "phase": phase, "loss": float(m["loss"]),
      "loss_by_source": {n: (float(m["loss_sum_K"][k] / m["rows_K"][k])
                             if m["rows_K"][k] else None) for k, n in enumerate(names)},
      "grad_norm": float(m["grad_norm"]), "clipped": bool(m["clipped"]),
      "spike": spike, "norm_mean": float(m["norm_mean"]), "top_leaves": top,
      "skipped_count": int(m["skipped_count"]),
      "lr": float(m["lr"]), "tokens_per_s": tokens_per_s, "step_time_s": step_time_s,
      "device_memory_bytes": None if device_memory_bytes is None
                             else [int(b) for b in device_memory_bytes],
  }


def missing_steps(records: list[dict], through_step: int) -> list[int]:
  """Steps in 1..through_step that have no step record."""
  have = {r["step"] for r in step_records(records)}
  return [s for s in range(1, through_step + 1) if s not in have]


DAMAGED_SUFFIX = ".damaged"  # metrics.jsonl's damaged lines, set aside on a resume


class MetricsLog:
  """metrics.jsonl: one JSON record a line, appended and flushed as the run goes."""

  def __init__(self, path: str, *, resume_after_step: int, write: bool = True, warn=print):
    """Keeps the records of steps <= resume_after_step (none for a fresh run). Damaged
    lines are not dropped: they are appended to DAMAGED_SUFFIX's file, with one warning.
    Without `write` (the processes other than 0) the records are kept in memory only."""
    self.path = path
    damaged = []
    kept = [r for r in read_records(path, damaged) if r["step"] <= resume_after_step]
    if write:
      if damaged:
        with open(path + DAMAGED_SUFFIX, "a") as f:
          f.writelines(f"{path}:{n}: {line}\n" for n, line in damaged)
        warn(f"warning: {path}: {len(damaged)} damaged line(s) (first: line {damaged[0][0]}) "
             f"moved to {path + DAMAGED_SUFFIX}; the good records are kept")
      write_atomic(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept))
    self.records = kept
    self._file = open(path, "a") if write else None

  def write(self, record: dict) -> None:
    self.records.append(record)
    if self._file:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()

  def close(self) -> None:
    if self._file:
      self._file.close()
