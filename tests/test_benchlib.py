"""benchlib's helpers, each on its own: the timing of rounds, the 95% interval of a median
and the verdicts it gives, the variants that split a clip's cost, and the clips that
bench_clip.py runs as passes of a loop."""

import argparse
import json
import math
import pathlib
import re
import time

import numpy as np
import pytest
from benchlib import clips, record, state_split, targets, timing, trees


@pytest.mark.parametrize("drained", [False, True])
def test_timed_steps_times_each_call_and_drains_before_each_when_asked(drained):
  events = []
  sync = lambda: events.append("sync")  # noqa: E731
  step = lambda: (events.append("step"), time.sleep(0.002))  # noqa: E731
  wall, inside = timing.timed_steps(sync, step, 3, drained=drained)
  assert len(inside) == 3 and all(t >= 0.002 for t in inside) and wall >= sum(inside)
  body = ["sync", "step"] * 3 if drained else ["step"] * 3
  assert events == ["sync", *body, "sync"]


def test_interleaved_rounds_rotate_the_order_with_the_collector_off():
  import gc
  order = []

  def measure(item):
    order.append(item)
    assert not gc.isenabled()
    return len(order)

  got = timing.interleaved_rounds("abc", 3, measure)
  assert order == list("abcbcacab") and gc.isenabled()
  assert got == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (20, (6, 15)), (40, (14, 27)), (100, (40, 61))])
def test_median_interval_is_the_order_statistics_of_the_binomial_table(n, ranks):
  """The distribution-free 95% interval for a median: the ranks of the standard table, its
  coverage at least 95%, and the next narrower pair of ranks below 95%."""
  values = [float(v) for v in range(1, n + 1)][::-1]  # in any order
  low, high, coverage = timing.median_interval(values)
  assert (low, high) == ranks and 0.95 <= coverage < 1
  k = ranks[0] + 1  # one rank in from each end
  inside = sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2**n
  assert inside < 0.95
  assert timing.median_interval(values[:5]) is None  # 2 * 2**-5 > 5%: no interval


@pytest.mark.parametrize("interval, want", [((0.99, 1.019, 0.96), "met"),
                                            ((1.021, 1.05, 0.96), "not met"),
                                            ((1.01, 1.03, 0.96), "cannot tell"),
                                            (None, "too few rounds")])
def test_a_verdict_needs_the_whole_interval_on_one_side_of_the_bound(interval, want):
  assert timing.verdict(interval, 1.02) == want


def test_target_verdicts_pair_each_round_with_its_peer():
  """examples/benchmark.py's verdicts: every clip's step and the control, each against its peer
  in the same round, on the clock the target names."""
  flat = lambda v: {"rounds": [v] * 10}  # noqa: E731
  rows = [{"model": "m", "batch": 1, "dtype": "f32", "variant": v, "label": v,
           "wall_ms": flat(w), "host_ms": flat(h)}
          for v, w, h in (("none", 10.0, 8.0), ("none_again", 10.1, 8.0),
                          ("andrea", 10.3, 8.2), ("optax", 10.4, 9.0))]
  rows[2]["wall_ms"] = {"rounds": [10.1 + 0.05 * i for i in range(10)]}  # 1.010-1.055
  got = {(v["variant"], v["target"]): v for v in targets.target_verdicts(rows)}
  assert set(got) == {("none_again", "wall vs adamw alone"), ("none_again", "host vs adamw alone"),
                      ("andrea", "wall vs adamw alone"), ("andrea", "wall vs optax's chain"),
                      ("andrea", "host vs adamw alone")}
  assert got["none_again", "wall vs adamw alone"]["verdict"] == "met"  # 1.01 every round
  wall = got["andrea", "wall vs adamw alone"]
  assert wall["median"] == pytest.approx(1.0325) and wall["verdict"] == "cannot tell"
  assert got["andrea", "host vs adamw alone"]["verdict"] == "met"  # 1.025 <= 1.05


def test_the_state_split_holds_the_clips_state_or_its_updates_and_not_both():
  """examples/benchmark.py's two halves of the clip: one carries arrays like the clip state
  and leaves the updates alone, the other clips with no state carried."""
  import jax
  import jax.numpy as jnp
  import clipjax
  grads = {"w": jnp.full((3, 4), 2.0), "b": jnp.arange(4.0)}
  clip = clipjax.andrea_clip(1.0)
  want_updates, want_state = jax.jit(clip.update)(grads, clip.init(grads))

  carried = state_split.carried_like_clip(1.0)
  state = carried.init(grads)
  assert [(x.shape, x.dtype) for x in state] == [(x.shape, x.dtype) for x in want_state]
  updates, new = jax.jit(carried.update)(grads, state)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, updates, grads))
  assert all(not jnp.array_equal(a, b) for a, b in zip(new, state))  # every array rewritten

  dropped = state_split.clip_without_state(1.0)
  assert jax.tree.leaves(dropped.init(grads)) == []
  updates, new = jax.jit(dropped.update)(grads, dropped.init(grads))
  assert jax.tree.leaves(new) == []
  assert jax.tree.all(jax.tree.map(jnp.array_equal, updates, want_updates))
  assert float(want_state.global_norm) > 1  # so the updates above were clipped


@pytest.mark.parametrize("impl", ["ffi", "optax"])
def test_clips_in_a_loop_are_the_clips_written_out(impl):
  """K clips as passes of a loop (max_norms scaled down pass by pass) give the same trees as
  the K clips written out with the same max_norm schedule."""
  import jax
  import numpy as np

  case = trees.Case.make("tiny", "f32", 0)
  fns = clips.JaxFunctions("ffi")
  norm0 = float(trees.f32_norm(case.random_tree(1)))
  make = lambda: [case.random_tree(1), case.random_tree(2)]  # noqa: E731
  ms = timing.max_norm_schedule("clip", norm0, 6)
  written_out = fns.clip(impl)(make(), tuple(ms))
  looped = fns.clip(impl, 3, timing.DECAY**2)(make(), tuple(ms[:2]))
  for x, y in zip(jax.tree.leaves(written_out), jax.tree.leaves(looped)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6)
  assert all(float(trees.f32_norm(t)) < norm0 / timing.NORM_RATIO for t in looped)


def test_a_record_holds_the_command_the_commit_the_devices_versions_and_numbers(tmp_path):
  meta = record.run_metadata(argparse.Namespace(steps=3, out="x.json"), "python x.py --steps 3")
  assert meta["command"] == "python x.py --steps 3" and meta["settings"] == {"steps": 3}
  checkout = (pathlib.Path(record.REPOSITORY) / ".git").exists()
  assert re.fullmatch(r"[0-9a-f]{40}(\+changes)?", meta["git_commit"]) if checkout else (
      meta["git_commit"] is None)
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["date"])
  assert meta["device_count"] >= 1 and meta["device_kinds"]
  assert all(meta[k] for k in ("python", "jax", "jaxlib", "optax", "clipjax"))
  path = tmp_path / "record.json"
  record.save_json({"meta": meta, "rows": [{"us": np.float32(1.5), "n": np.int64(2)}]}, path,
                   complete=False)
  written = json.loads(path.read_text())
  assert written["rows"] == [{"us": 1.5, "n": 2}] and written["meta"]["complete"] is False
