"""Batches drawn from the sources by the bandit's weights: made on the host by a background
thread, put on the devices one step ahead by the training loop's thread.

A batch is a pure function of (seed, step, weights): its random generator is seeded by
the seed and the step number only, so a resumed run draws exactly the batches an
uninterrupted one would. Each row picks a source by the weights, then a random window
of context_length + 1 tokens from that source's token stream. Every process draws the
whole global batch's sources and window starts (a few numbers a row), then reads the
token windows of its own rows only (`rows`): the global batch is the same whatever the
number of processes.

The work is split by what may run where:

- HostBatches' thread samples the numpy batches of the current phase ahead of the
  training step. It cannot run past a phase boundary, since the next weights depend on
  the losses of the phase that is ending. It never calls JAX.
- Prefetcher, on the training loop's thread, takes them and builds the global device
  arrays (`jax.make_array_from_process_local_data`), one step ahead of the step that
  uses them. In a multi-process run this may talk to the other processes, and JAX's
  cross-process work must run on one thread, in the same order on every process.
"""

import collections
import dataclasses
import queue
import threading
from typing import Sequence

import jax
import numpy as np

_DATA_SEED_STREAM = 0xDA7A


@dataclasses.dataclass(frozen=True)
class Batch:
  tokens_BxL1: np.ndarray  # int32 (rows, context_length + 1): inputs and shifted targets
  source_B: np.ndarray  # int32 (rows,): which source each row came from


def sample_batch(
    streams: Sequence[np.ndarray], weights: np.ndarray, *, seed: int, step: int,
    batch_size: int, context_length: int, rows: np.ndarray | None = None) -> Batch:
  """The global batch of `step`, or only its `rows` (indices into the batch)."""
  rng = np.random.default_rng([seed, _DATA_SEED_STREAM, step])
  source_B = rng.choice(len(streams), size=batch_size, p=weights)
  stream_lengths = np.array([len(s) for s in streams])
  start_B = rng.integers(0, stream_lengths[source_B] - context_length)
  if rows is not None:
    source_B, start_B = source_B[rows], start_B[rows]
  window_L1 = np.arange(context_length + 1)
  tokens_BxL1 = np.stack(
      [streams[s][start + window_L1] for s, start in zip(source_B, start_B)])
  return Batch(tokens_BxL1.astype(np.int32), source_B.astype(np.int32))


def process_rows(sharding: jax.sharding.Sharding, batch_size: int) -> np.ndarray:
  """The rows of a (batch_size, ...) array split by `sharding` that this process's devices
  hold, in the order `jax.make_array_from_process_local_data` expects them."""
  slices = {(s.start or 0, batch_size if s.stop is None else s.stop)
            for s, *_ in sharding.addressable_devices_indices_map((batch_size,)).values()}
  return np.concatenate([np.arange(start, stop) for start, stop in sorted(slices)])


class HostBatches:
  """Samples a phase's numpy batches (this process's rows) on a background thread."""

  def __init__(self, streams: Sequence[np.ndarray], *, seed: int, batch_size: int,
               context_length: int, rows: np.ndarray | None = None, depth: int = 4):
    self._sample_kwargs = dict(seed=seed, batch_size=batch_size,
                               context_length=context_length, rows=rows)
    self._streams = streams
    self._jobs = queue.Queue()
    self._batches = queue.Queue(maxsize=depth)
    self._closing = threading.Event()
    self.planned_through = 0  # the last step asked for so far
    self._thread = threading.Thread(target=self._work, daemon=True)
    self._thread.start()

  def start_phase(self, first_step: int, last_step: int, weights: np.ndarray) -> None:
    """Asks for the batches of steps first_step..last_step drawn with these weights."""
    assert first_step == self.planned_through + 1 or self.planned_through == 0, (
        first_step, self.planned_through)
    self._jobs.put((first_step, last_step, np.array(weights)))
    self.planned_through = last_step

  def next(self, step: int) -> Batch:
    made_step, item = self._batches.get()
    if isinstance(item, BaseException):
      raise RuntimeError("the batch sampling thread failed") from item
    assert made_step == step, (made_step, step)
    return item

  def close(self) -> None:
    self._closing.set()
    self._jobs.put(None)
    while self._thread.is_alive():  # unblock a put into a full queue
      try:
        self._batches.get(timeout=0.05)
      except queue.Empty:
        pass

  def _work(self) -> None:
    while (job := self._jobs.get()) is not None:
      first_step, last_step, weights = job
      for step in range(first_step, last_step + 1):
        if self._closing.is_set():
          return
        try:
          item = sample_batch(self._streams, weights, step=step, **self._sample_kwargs)
        except BaseException as e:  # handed to the training loop, which re-raises
          item = e
        self._batches.put((step, item))


class Prefetcher:
  """The device batches of the steps, each put on the devices `ahead` steps before its
  step asks for it. Every method runs on the caller's thread."""

  def __init__(self, streams: Sequence[np.ndarray], *, seed: int, batch_size: int,
               context_length: int, sharding: jax.sharding.Sharding | None = None,
               ahead: int = 1, depth: int = 4):
    """sharding: how a batch's rows are split over the devices (default: all on the
    default device)."""
    # jax.sharding.SingleDeviceSharding is deprecated where its factory exists.
    single = (getattr(jax.sharding, "make_single_device_sharding", None)
              or jax.sharding.SingleDeviceSharding)
    sharding = sharding or single(jax.devices()[0])
    self._sharding = sharding
    self._shapes = ((batch_size, context_length + 1), (batch_size,))
    self._host = HostBatches(streams, seed=seed, batch_size=batch_size,
                             context_length=context_length,
                             rows=process_rows(sharding, batch_size), depth=depth)
    self._ahead = ahead
    self._staged = collections.OrderedDict()  # step -> device batch, put but not used yet
    self._next_to_stage = 1

  @property
  def planned_through(self) -> int:
    return self._host.planned_through

  def start_phase(self, first_step: int, last_step: int, weights: np.ndarray) -> None:
    """Asks for the batches of steps first_step..last_step drawn with these weights."""
    if not self._staged:
      self._next_to_stage = first_step
    self._host.start_phase(first_step, last_step, weights)

  def next(self, step: int) -> tuple[jax.Array, jax.Array]:
    """The device batch (tokens_BxL1, source_B) of `step`."""
    self._stage_through(step)
    return self._staged.pop(step)

  def put_ahead(self, step: int) -> None:
    """Puts the batches of the `ahead` steps after `step` on the devices, as far as the
    planned phase goes (called once `step` is dispatched)."""
    self._stage_through(min(step + self._ahead, self.planned_through))

  def _stage_through(self, step: int) -> None:
    while self._next_to_stage <= step:
      batch = self._host.next(self._next_to_stage)
      self._staged[self._next_to_stage] = tuple(
          jax.make_array_from_process_local_data(self._sharding, local, shape)
          for local, shape in zip((batch.tokens_BxL1, batch.source_B), self._shapes))
      self._next_to_stage += 1

  def close(self) -> None:
    self._host.close()
