"""One program on every process: joining the other processes, and what they do together.

A run of several processes (one per host, or one per GPU) is the same command on each.
`launch` joins them with `jax.distributed.initialize`, before JAX touches a device:

- JAX's own cluster detection comes first: under SLURM (`srun`), Open MPI (`mpirun`), on
  Cloud TPU pods and Kubernetes jobs, JAX finds the coordinator, the process count and
  this process's id itself.
- Otherwise `--coordinator HOST:PORT`, `--num-processes N` and `--process-id I` give them,
  or the environment variables JAX_COORDINATOR_ADDRESS (which JAX reads itself),
  JAX_NUM_PROCESSES and JAX_PROCESS_ID.
- With none of these the run is one process, and nothing is initialized.

Every process then runs the same steps on one global mesh. Process 0 alone writes the
run's files and prints; decisions that depend on something other than the replicated
metrics (the wall clock) are process 0's, handed to the others (`agree`).

SIGTERM (a scheduler's preemption or time limit, `scancel`, `kill`) stops the run after a
checkpoint, with nothing lost (`stop_requested`): on one process at the next step; on
several, JAX's preemption notifier catches it on any of them, and every process stops
after the same step, the one JAX's preemption sync point names.

A process that dies is found by JAX's coordination service, which stops hearing its
heartbeats: every other process then ends within --heartbeat-timeout-s with JAX's error
"The following tasks are unhealthy (stopped sending heartbeats): ID", or sooner with
the collective library's error, where one meets the dead peer first. A process that
fails with an error says so and exits at once (`exit_on_error`), so that the others
learn of it the same way instead of waiting for it at JAX's shutdown barrier.
"""

import contextlib
import os
import signal
import sys
import threading
import traceback
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..config import ConfigError
from . import status

ENV = {"num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def launch(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None, heartbeat_timeout_s: int = 100) -> None:
  """Joins the run's other processes, if it has any (see the module docstring); then only
  process 0 prints status lines. Calling it again in a process that joined is a no-op."""
  if jax.distributed.is_initialized():
    return
  if heartbeat_timeout_s < 1:
    raise ConfigError(f"--heartbeat-timeout-s must be >= 1, got {heartbeat_timeout_s}")
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  given = {"num_processes": num_processes, "process_id": process_id}
  for name, var in ENV.items():
    if given[name] is None and os.environ.get(var):
      if not os.environ[var].isdigit():
        raise ConfigError(f"{var}={os.environ[var]!r}: expected a number")
      given[name] = int(os.environ[var])
  explicit = coordinator is not None or any(v is not None for v in given.values())
  if not explicit and cluster_process_count() <= 1:
    return
  if explicit and given["num_processes"] == 1:
    return
  try:
    jax.distributed.initialize(coordinator, given["num_processes"], given["process_id"],
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"cannot start a run of several processes: {e} (give --coordinator "
                      "HOST:PORT, --num-processes and --process-id, or run under a "
                      "launcher JAX detects: SLURM, Open MPI)") from None
  status.speak(jax.process_index() == 0)


def cluster_process_count() -> int:
  """The process count of the cluster launcher JAX detects (SLURM, Open MPI, Cloud TPU,
  Kubernetes), or 1 where there is none. JAX's detection is its own; it has no public
  name, so a JAX that moves it finds no cluster (the flags still work)."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
  except ImportError:
    return 1
  with warnings.catch_warnings():  # Kubernetes without the `kubernetes` package warns
    warnings.simplefilter("ignore")
    for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
      try:
        if not env.opt_in_only_method and env.is_env_present():
          return int(env.get_process_count())
      except Exception:  # noqa: BLE001 - a launcher half present is not ours to use
        continue
  return 1


def is_main() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def agree(flag: bool) -> bool:
  """Process 0's `flag`, on every process (each must call this at the same point)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def barrier(name: str) -> None:
  """Waits until every process gets here (each must call this at the same point)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


_sigterm = threading.Event()  # one process: SIGTERM arrived (see handle_sigterm)


def stop_requested(step: int) -> bool:
  """Whether the run should save and stop after `step`, for a SIGTERM. Every process
  calls this at every step: with several, it is JAX's preemption sync point, which is
  True at the same step on all of them."""
  if jax.process_count() > 1:
    return multihost_utils.reached_preemption_sync_point(step)
  return _sigterm.is_set()


@contextlib.contextmanager
def handle_sigterm():
  """SIGTERM, while inside, asks the run to stop after a checkpoint (stop_requested)
  instead of killing it. (With several processes JAX's own notifier catches it.)"""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _sigterm.clear()
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: _sigterm.set())
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def exit_on_error():
  """In a run of several processes an error ends this process at once, after its
  message: the others then stop within the heartbeat timeout, rather than waiting at
  JAX's shutdown barrier for a process that will never reach it."""
  try:
    yield
  except BaseException as e:  # noqa: BLE001 - every way out of a multi-process run
    if not (jax.distributed.is_initialized() and jax.process_count() > 1):
      raise
    code, message = (e.code, None) if isinstance(e, SystemExit) else (1, type(e).__name__)
    if isinstance(code, str):  # sys.exit("message"), which os._exit would not print
      code, message = 1, code
    elif message:
      traceback.print_exc()
    print(f"process {jax.process_index()} of {jax.process_count()} stopped"
          + (f": {message}" if message else ""), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code if isinstance(code, int) and code else 1)
