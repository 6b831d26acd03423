"""Orbax checkpoints of a run: parameters, optimizer state, and the run's host-side state.

The host-side part (JSON) holds the step, the bandit state and the settings the run was
started with. Batches are a pure function of (seed, step, bandit weights) and the phase
boundaries of the seed, so with these restored a resumed run draws the same data and
computes the same losses as one that was never interrupted.

Every checkpoint is checked when it is restored. At save time, once Orbax has finished
writing it, the SHA-256 of each of its files goes into CHECKSUMS inside it (written
atomically). A checkpoint is used only if:

- every file matches its checksum;
- it restores without error;
- it holds only finite numbers.

Otherwise one line names it and what is wrong, it is moved aside (to CHECKPOINTS-unusable/)
and the next older checkpoint is tried.

In a run of several processes every process saves and restores its own shards (Orbax's
multi-host checkpointing); process 0 alone writes the checksums and moves unusable
checkpoints aside, and its verdict on a checkpoint's files is every process's.
"""

import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ..reports import metrics
from . import distributed

CHECKSUMS = "clipjax-checksums.json"


class CheckpointError(Exception):
  """No checkpoint of the run directory can be used."""


def _file_digests(step_dir: str) -> dict:
  digests = {}
  for root, _, files in os.walk(step_dir):
    for name in files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel == CHECKSUMS:
        continue
      h = hashlib.sha256()
      with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          h.update(block)
      digests[rel] = h.hexdigest()
  return digests


def directory_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, files in os.walk(directory) for name in files)


def all_finite(tree) -> bool:
  """Whether every float array in `tree` is finite: reduced on the devices, where the
  arrays are, to one replicated answer (no array is fetched)."""
  floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_all_finite(floats))


@jax.jit
def _all_finite(floats):
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats]))


def _first_line(e: Exception) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


class RunCheckpoints:

  def __init__(self, directory: str, *, fresh: bool, keep: int = 2):
    """fresh: delete the checkpoints an earlier run left in this directory (the caller
    asks before it does); keep: how many of the latest checkpoints are kept."""
    self.directory = os.path.abspath(directory)
    if fresh and os.path.isdir(self.directory) and distributed.is_main():
      shutil.rmtree(self.directory)
    distributed.barrier("the checkpoint directory is ready")
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, params, opt_state, host_state: dict) -> str:
    """Saves checkpoint `step` (each array once: the parameters and the optimizer state),
    then its checksums; returns its directory."""
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        host=ocp.args.JsonSave(host_state)), force=True)
    self._manager.wait_until_finished()
    if distributed.is_main():
      digests = _file_digests(self.step_dir(step))
      metrics.write_json_atomic(os.path.join(self.step_dir(step), CHECKSUMS), digests)
    distributed.barrier(f"checkpoint {step} is saved")
    return self.step_dir(step)

  def _problem(self, step: int) -> str | None:
    """What is wrong with the files of checkpoint `step`, or None."""
    path = os.path.join(self.step_dir(step), CHECKSUMS)
    try:
      with open(path) as f:
        want = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      return f"its checksums are unreadable ({type(e).__name__})"
    have = _file_digests(self.step_dir(step))
    changed = sorted(k for k in want if have.get(k) != want[k])
    if changed:
      return f"{len(changed)} file(s) differ from their checksums, e.g. {changed[0]}"
    return None

  def restore_latest_good(self, params_like, opt_state_like, log, check_host=None):
    """(step, host_state, params, opt_state) of the newest usable checkpoint, or None if
    there is none at all. `check_host(host_state)` may refuse a readable checkpoint (made
    with other settings) by raising; that leaves every checkpoint where it is. Only damage
    sets one aside: files that differ from their checksums, a checkpoint that does not
    restore, or one that holds NaN or inf. Each is named by one `log` line; if checkpoints
    exist but none is usable, raises CheckpointError."""
    tried = []
    for step in reversed(self.steps()):
      problem = self._problem(step) if distributed.is_main() else None
      if not distributed.agree(problem is None):  # process 0's verdict holds for all
        problem = problem or "process 0 found its files changed"
      host = None
      if problem is None:
        try:
          host = self._manager.restore(step, args=ocp.args.Composite(
              host=ocp.args.JsonRestore()))["host"]
        except Exception as e:  # noqa: BLE001 - any failure means: try an older one
          problem = f"its host state does not restore ({_first_line(e)})"
      if problem is None:
        if check_host is not None:
          check_host(host)
        try:
          target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                {"params": params_like, "opt_state": opt_state_like})
          arrays = self._manager.restore(step, args=ocp.args.Composite(
              arrays=ocp.args.StandardRestore(target)))["arrays"]
        except Exception as e:  # noqa: BLE001 - any failure means: try an older one
          problem = f"it does not restore ({_first_line(e)})"
        else:
          if all_finite(arrays):
            return step, host, arrays["params"], arrays["opt_state"]
          problem = "it holds NaN or inf"
      tried.append(step)
      # Moved aside (kept for a look), so that this run can save its own checkpoint there.
      aside = os.path.join(f"{self.directory}-unusable", str(step))
      if distributed.is_main():
        shutil.rmtree(aside, ignore_errors=True)
        shutil.move(self.step_dir(step), aside)
      distributed.barrier(f"checkpoint {step} is moved aside")
      self._manager.reload()
      log(f"checkpoint {self.step_dir(step)} is unusable: {problem}; moved to {aside}, "
          "trying an older one")
    if tried:
      raise CheckpointError(f"no usable checkpoint in {self.directory} "
                            f"(tried steps {', '.join(map(str, tried))})")
    return None

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
