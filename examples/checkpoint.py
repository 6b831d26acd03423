"""Orbax checkpoints of a run: parameters, optimizer state, and the run's host-side state.

The host-side part (JSON) holds the step, the bandit state and the settings the run was
started with. Batches are a pure function of (seed, step, bandit weights) and the phase
boundaries of the seed, so with these restored a resumed run draws the same data and
computes the same losses as one that was never interrupted.
"""

import os
import shutil

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:

  def __init__(self, directory: str, *, fresh: bool, keep: int = 3):
    """fresh: delete the checkpoints an earlier run left in this directory."""
    self.directory = os.path.abspath(directory)
    if fresh and os.path.isdir(self.directory):
      shutil.rmtree(self.directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, params, opt_state, host_state: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        host=ocp.args.JsonSave(host_state)), force=True)

  def restore_host_state(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(
        host=ocp.args.JsonRestore()))["host"]

  def restore_arrays(self, step: int, params_like, opt_state_like):
    """(params, opt_state) of `step`, shaped like the given templates."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params_like, "opt_state": opt_state_like})
    arrays = self._manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(target)))["arrays"]
    return arrays["params"], arrays["opt_state"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
