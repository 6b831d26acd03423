"""The steps of a run, in order, with the host never waiting for the devices between them.

For each step:

  at a phase boundary  every earlier step's metrics are fetched, and the bandit's new
                       weights are logged (the phase's batches need them)
  the batch            put on the devices while the previous step ran (pipeline.py)
  the jitted step      dispatched; the host goes on while the devices run it, up to
                       MAX_IN_FLIGHT steps ahead of them (more gains nothing, and JAX's
                       CPU backend can deadlock with dozens of cross-process steps queued)
  the next batch       put on the devices
  the metrics          fetched in one go every --log-every steps, one step late: the
                       devices are still busy with this step while the host logs the
                       group, feeds the bandit each step's per-source losses in order,
                       and stops the run after --nonfinite-stop NaN/inf steps in a row
  checkpoints          every --checkpoint-every steps and at the end (all metrics
                       fetched first, so that no checkpoint holding NaN is saved), and
                       before stopping for SIGTERM or Ctrl-C (distributed.stop_requested;
                       an --overwrite with no checkpoint yet stops without one, and the
                       run it replaced is put back)

The bandit sees every step, in order, whatever --log-every is: the weights and the phase
boundaries are those of a loop that fetched each step's metrics at once.
"""

import bisect
import collections
import contextlib
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
from tqdm import tqdm

from ..config import TrainConfig
from ..data import bandit, corpus, pipeline
from ..reports import metrics, throughput
from . import checkpoint, distributed, run_dir as run_dir_lib, sharding, status

MAX_IN_FLIGHT = 2  # steps dispatched and not yet finished, at most


class TrainingDiverged(Exception):
  """The loss or the gradient norm stayed NaN/inf for --nonfinite-stop steps in a row."""


class Stopped(Exception):
  """A stop signal (SIGTERM, Ctrl-C) stopped the run after a checkpoint, which --resume
  continues, or before an --overwrite's first, with the run it replaced put back."""


@dataclasses.dataclass
class State:
  """What changes from step to step."""
  params: Any
  opt_state: Any
  bandit: bandit.BanditState
  step_done: int  # the last step whose update is in params
  pending: list = dataclasses.field(default_factory=list)  # (step, phase, device metrics)
  last_fetch: float | None = None  # when the latest metrics were fetched (or step 1 began)
  nonfinite_steps: list[int] = dataclasses.field(default_factory=list)  # the latest run
  in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)


@dataclasses.dataclass(frozen=True)
class Loop:
  """What the steps of one run share."""
  cfg: TrainConfig
  train_step: Callable
  prefetcher: pipeline.Prefetcher
  checkpoints: checkpoint.RunCheckpoints
  run_dir: run_dir_lib.RunDir
  log: metrics.MetricsLog
  say: Callable[[str], None]  # one line, above the progress bar
  bar: tqdm
  identity: dict  # the settings a resume must share, saved in every checkpoint
  phase_starts: list[int]
  last_step: int
  started: float
  leaf_names: list[str]  # the paths of the clip state's leaf norms ([] without a clip)
  flops_per_token: float  # throughput.flops_per_token
  peak_flops: float | None  # the devices' summed peak, for MFU; None if unknown


def run_steps(loop: Loop, state: State, until: int | None = None) -> int | None:
  """Steps step_done + 1 .. `until` (default: the run's last step), every metric fetched
  at the end; returns the step after which --time-limit-s stopped the run, or None."""
  cfg, first = loop.cfg, state.step_done + 1
  phase_bounds = loop.phase_starts + [cfg.steps + 1]
  for step in range(first, (until or loop.last_step) + 1):
    phase = bisect.bisect_right(loop.phase_starts, step) - 1
    phase_end = phase_bounds[phase + 1] - 1
    if step == loop.phase_starts[phase]:
      fetch_metrics(loop, state)
      start_phase(loop, state, step, phase, phase_end)
    if step > loop.prefetcher.planned_through:
      loop.prefetcher.start_phase(step, min(phase_end, loop.last_step), state.bandit.weights)
    tokens_BxL1, source_B = loop.prefetcher.next(step)
    compiling = (status.timed("compiling the training step", loop.say)
                 if state.last_fetch is None else contextlib.nullcontext())
    with compiling:
      state.params, state.opt_state, step_metrics = loop.train_step(
          state.params, state.opt_state, tokens_BxL1, source_B, np.int32(step))
    if state.last_fetch is None:  # the step is compiled; the clock starts as it runs
      state.last_fetch = time.perf_counter()
    loop.prefetcher.put_ahead(step)
    state.in_flight.append(step_metrics["loss"])
    if len(state.in_flight) > MAX_IN_FLIGHT:
      jax.block_until_ready(state.in_flight.popleft())
    state.pending.append((step, phase, step_metrics))
    state.step_done = step
    if len(state.pending) > cfg.log_every:
      fetch_metrics(loop, state, keep_latest=True)
    out_of_time = time_is_up(loop, step)
    stop = distributed.stop_requested(step)
    if step % cfg.checkpoint_every == 0 or step == loop.last_step or out_of_time or stop:
      fetch_metrics(loop, state)
      if stop and distributed.agree(loop.run_dir.aside is not None):
        raise Stopped(f"{distributed.stop_cause()}: stopped after step {step} of "
                      f"{cfg.steps}, before this --overwrite's first checkpoint: the run "
                      f"it replaced is back in {cfg.out_dir}")
      save_checkpoint(loop, state)
    if stop:
      raise Stopped(saved_and_stopped(distributed.stop_cause(), step, loop))
    if out_of_time and step < loop.last_step:
      loop.say(f"--time-limit-s {cfg.time_limit_s:g} reached: stopping after step {step} "
               f"of {cfg.steps}")
      return step
  fetch_metrics(loop, state)
  return None


def saved_and_stopped(cause: str, step: int, loop: Loop) -> str:
  """The line that ends a run stopped by `cause` after `step`, its checkpoint saved."""
  return (f"{cause}: stopped after step {step} of {loop.cfg.steps}, saved in "
          f"{loop.checkpoints.directory}; --resume continues the run")


def time_is_up(loop: Loop, step: int) -> bool:
  """Whether --time-limit-s has run out. Several processes decide together, as process 0
  finds, every --log-every steps (at a step every process reaches)."""
  limit = loop.cfg.time_limit_s
  if limit is None:
    return False
  if jax.process_count() > 1 and step % loop.cfg.log_every:
    return False
  return distributed.agree(time.perf_counter() - loop.started > limit)


def start_phase(loop: Loop, state: State, step: int, phase: int, phase_end: int) -> None:
  """A phase boundary: new weights from the ending phase's rewards, logged and printed."""
  reward = None
  if phase > 0:
    state.bandit, reward = bandit.end_phase(state.bandit, loop.cfg.bandit_config)
  record = metrics.phase_record(step, phase, phase_end - step + 1, corpus.SOURCE_NAMES,
                                state.bandit.weights, reward)
  loop.log.write(record)
  weights = " ".join(f"{n} {w:.2f}" for n, w in record["weights"].items())
  rewards = "" if reward is None else " | reward " + " ".join(f"{r:.2f}" for r in reward)
  loop.say(f"phase {phase} at step {step} ({record['length']} steps): weights "
           f"{weights}{rewards}")


def fetch_metrics(loop: Loop, state: State, keep_latest: bool = False) -> None:
  """Fetches the pending steps' metrics in one go (all but the latest step's, if
  `keep_latest`), logs them and feeds the bandit step by step, in order; stops the run
  after --nonfinite-stop NaN/inf steps in a row. Each step of the group is given the
  group's mean step time."""
  group = state.pending[:-1] if keep_latest else state.pending
  if not group:
    return
  state.pending = state.pending[len(group):]
  fetched = jax.device_get([step_metrics for _, _, step_metrics in group])
  now = time.perf_counter()
  seconds, state.last_fetch = (now - state.last_fetch) / len(group), now
  tokens_per_s = loop.cfg.batch_size * loop.cfg.context_length / max(seconds, 1e-9)
  memory = sharding.memory_in_use((state.params, state.opt_state))
  for (step, phase, _), m in zip(group, fetched):
    loop.log.write(metrics.step_record(step, phase, corpus.SOURCE_NAMES, m, tokens_per_s,
                                       seconds, memory, loop.leaf_names))
    observe(loop, state, step, m)
  loop.bar.update(len(group))
  postfix = dict(loss=f"{m['loss']:.3f}", gnorm=f"{m['grad_norm']:.2f}", phase=phase,
                 tok_s=f"{tokens_per_s:,.0f}")
  if (mfu := throughput.mfu(tokens_per_s, loop.flops_per_token, loop.peak_flops)) is not None:
    postfix["mfu"] = f"{mfu:.1%}"
  loop.bar.set_postfix(postfix)


def observe(loop: Loop, state: State, step: int, m: dict) -> None:
  """Feeds one step's per-source losses to the bandit; NaN/inf never reaches it."""
  if np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]):
    state.bandit = bandit.observe(state.bandit, m["loss_sum_K"], m["rows_K"])
    state.nonfinite_steps = []
    return
  state.nonfinite_steps.append(step)
  if len(state.nonfinite_steps) >= loop.cfg.nonfinite_stop:
    first = state.nonfinite_steps[0]
    good = [s for s in loop.checkpoints.steps() if s < first]
    raise TrainingDiverged(
        f"the loss or gradient norm was NaN/inf for {len(state.nonfinite_steps)} steps in "
        f"a row (steps {first}-{step}); stopping. The latest checkpoint before them: "
        + (f"step {good[-1]} in {loop.checkpoints.directory}" if good else "none"))


def save_checkpoint(loop: Loop, state: State) -> None:
  """Saves the state after step_done, unless it holds NaN or inf; prints where."""
  step = state.step_done
  if state.nonfinite_steps or not checkpoint.all_finite((state.params, state.opt_state)):
    loop.say(f"step {step}: not saving a checkpoint that holds NaN or inf")
    return
  path = loop.checkpoints.save(step, state.params, state.opt_state, {
      "step": step, "bandit": state.bandit.to_json(), "identity": loop.identity})
  loop.say(f"step {step}: checkpoint {path} "
           f"({checkpoint.directory_bytes(path) / 2**20:.1f} MB)")
  loop.run_dir.keep_new()  # a run replaced by --overwrite is deleted only now
