"""Batches drawn from the sources by the bandit's weights, made ahead on a background thread.

A batch is a pure function of (seed, step, weights): its random generator is seeded by
the seed and the step number only, so a resumed run draws exactly the batches an
uninterrupted one would. Each row picks a source by the weights, then a random window
of context_length + 1 tokens from that source's token stream.

The Prefetcher makes the batches of the current phase on a thread and puts them on the
device while the accelerator runs earlier steps. It cannot run past a phase boundary,
since the next weights depend on the losses of the phase that is ending.
"""

import dataclasses
import queue
import threading
from typing import Sequence

import jax
import numpy as np

_DATA_SEED_STREAM = 0xDA7A


@dataclasses.dataclass(frozen=True)
class Batch:
  tokens_BxL1: np.ndarray  # int32 (batch, context_length + 1): inputs and shifted targets
  source_B: np.ndarray  # int32 (batch,): which source each row came from


def sample_batch(
    streams: Sequence[np.ndarray], weights: np.ndarray, *, seed: int, step: int,
    batch_size: int, context_length: int) -> Batch:
  rng = np.random.default_rng([seed, _DATA_SEED_STREAM, step])
  source_B = rng.choice(len(streams), size=batch_size, p=weights)
  stream_lengths = np.array([len(s) for s in streams])
  start_B = rng.integers(0, stream_lengths[source_B] - context_length)
  window_L1 = np.arange(context_length + 1)
  tokens_BxL1 = np.stack(
      [streams[s][start + window_L1] for s, start in zip(source_B, start_B)])
  return Batch(tokens_BxL1.astype(np.int32), source_B.astype(np.int32))


class Prefetcher:
  """Yields the device batches of one phase at a time, made on a background thread."""

  def __init__(self, streams: Sequence[np.ndarray], *, seed: int, batch_size: int,
               context_length: int, depth: int = 4, sharding=None):
    """sharding: where the batches are put (default: the default device)."""
    self._sample_kwargs = dict(
        seed=seed, batch_size=batch_size, context_length=context_length)
    self._streams = streams
    self._sharding = sharding
    self._jobs = queue.Queue()
    self._batches = queue.Queue(maxsize=depth)
    self._closing = threading.Event()
    self._thread = threading.Thread(target=self._work, daemon=True)
    self._thread.start()

  def start_phase(self, first_step: int, last_step: int, weights: np.ndarray) -> None:
    """Asks for the batches of steps first_step..last_step drawn with these weights."""
    self._jobs.put((first_step, last_step, np.array(weights)))

  def next(self, step: int) -> tuple[jax.Array, jax.Array]:
    made_step, item = self._batches.get()
    if isinstance(item, BaseException):
      raise RuntimeError("the batch prefetch thread failed") from item
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
          batch = sample_batch(self._streams, weights, step=step, **self._sample_kwargs)
          item = jax.device_put((batch.tokens_BxL1, batch.source_B), self._sharding)
        except BaseException as e:  # handed to the training loop, which re-raises
          item = e
        self._batches.put((step, item))
