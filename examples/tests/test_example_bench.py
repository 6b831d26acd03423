"""The speed benchmark (examples/experiments/bench_speed.py) on the CPU, tiny: its rounds,
its variants and what it writes. The figures themselves only mean something on a GPU."""

import json

import pytest

import bench_speed
from gpt.reports import metrics

TINY = ["--config", "tiny", "--batch-size", "8", "--context-length", "32", "--vocab-size",
        "512", "--max-source-mb", "0.05", "--rounds", "2", "--round-steps", "4"]


@pytest.mark.slow
def test_the_benchmark_times_the_loop_against_its_step_and_the_variants(tmp_path, cache_dir):
  out = tmp_path / "bench"
  results = bench_speed.main(TINY + [
      "--cache-dir", cache_dir, "--out-dir", str(out),
      "--variants", "remat=none;dtype=float32,remat=dots;attention=cudnn"])
  loop_vs_step = results["loop_against_step"]
  assert set(loop_vs_step["round_seconds"]) == {"loop", "step"}
  assert all(len(t) == 2 and min(t) > 0 for t in loop_vs_step["round_seconds"].values())
  assert loop_vs_step["ratio"] == pytest.approx(
      loop_vs_step["tokens_per_s"]["loop"] / loop_vs_step["tokens_per_s"]["step"])
  assert loop_vs_step["mfu"] == {"loop": None, "step": None}  # a CPU has no known peak
  # The loop's rounds trained the example: 1 warm-up and 2 rounds of 4 steps, logged.
  records = metrics.read_records(str(out / "loop-run" / "metrics.jsonl"))
  assert [r["step"] for r in metrics.step_records(records)] == list(range(1, 13))
  assert not (out / "loop-run" / ".lock").exists()  # the run directory is released
  rows = {row["variant"]: row for row in results["variants"]}
  assert "cuDNN" in rows["attention=cudnn"]["skipped"]  # not on a CPU
  for name in ("remat=none", "dtype=float32,remat=dots"):
    assert rows[name]["tokens_per_s"] > 0 and rows[name]["compile_s"] > 0
    assert len(rows[name]["round_seconds"]) == 2
  assert rows["dtype=float32,remat=dots"]["remat"] == "dots"
  assert results["kernels"] is None  # no GPU to trace
  written = json.loads((out / "results.json").read_text())
  assert written["variants"][0]["variant"] and written["meta"]["complete"]
  assert written["meta"]["command"].startswith("python examples/experiments/bench_speed.py")
  assert written["meta"]["git_commit"] and written["meta"]["clipjax"]
  assert "The loop runs at" in (out / "report.md").read_text()
