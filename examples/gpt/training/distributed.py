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

SIGTERM (a scheduler's preemption or time limit, `scancel`, `kill`) and SIGINT (Ctrl-C)
stop the run after a checkpoint, with nothing lost (`stop_requested`): on one process at
the next step; on several, JAX's preemption notifier catches SIGTERM on any of them (a
Ctrl-C is handed to it as one), and every process stops after the same step, the one
JAX's preemption sync point names. A second Ctrl-C ends the process at once: what it
leaves is what a kill leaves, which the next start puts right (run_dir.py, checkpoint.py).

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


# The stop signals, by the names the closing line gives them.
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
INTERRUPTED_EXIT_STATUS = 130  # a shell's exit status for a program that Ctrl-C ended
_stop_signals: list[int] = []  # this process's, in order of arrival (handle_stop_signals)


def stop_requested(step: int) -> bool:
  """Whether the run should save and stop after `step`, for a stop signal. Every process
  calls this at every step: with several, it is JAX's preemption sync point, which is
  True at the same step on all of them."""
  if jax.process_count() > 1:
    return multihost_utils.reached_preemption_sync_point(step)
  return bool(_stop_signals)


def stop_cause() -> str:
  """The first stop signal this process received, by name ("SIGTERM" where another
  process received it)."""
  return STOP_SIGNALS[_stop_signals[0]] if _stop_signals else "SIGTERM"


def stop_exit_status() -> int:
  """The exit status of a run that a stop signal ended: a shell's for Ctrl-C, else 1."""
  interrupted = _stop_signals[:1] == [signal.SIGINT]
  return INTERRUPTED_EXIT_STATUS if interrupted else 1


@contextlib.contextmanager
def handle_stop_signals():
  """SIGTERM and SIGINT, while inside, ask the run to stop after a checkpoint
  (stop_requested) instead of killing it; a second SIGINT ends the process at once.
  (With several processes JAX's own notifier catches SIGTERM.)

  A Python signal handler runs only when the main thread is between bytecodes, which a
  compile or a wait on the devices can put off for minutes. The signals are read
  instead from Python's wakeup file descriptor, on a thread of their own, which acts at
  once."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _stop_signals.clear()
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  previous = {signum: signal.signal(signum, lambda signum, frame: None)
              for signum in STOP_SIGNALS}
  previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  watcher = threading.Thread(target=_watch_stop_signals, args=(read_fd,), daemon=True,
                             name="stop signals")
  watcher.start()
  try:
    yield
  finally:
    signal.set_wakeup_fd(previous_fd)
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    os.close(write_fd)  # the watcher reads the end of the pipe and returns
    watcher.join()
    os.close(read_fd)


def _watch_stop_signals(read_fd: int) -> None:
  while received := os.read(read_fd, 64):
    for signum in received:
      if signum not in STOP_SIGNALS:
        continue
      if signum == signal.SIGINT and signal.SIGINT in _stop_signals:
        os.write(2, b"second Ctrl-C: exiting at once; --resume continues from the last "
                    b"checkpoint saved\n")
        os._exit(INTERRUPTED_EXIT_STATUS)
      _stop_signals.append(signum)
      if signum == signal.SIGINT and jax.distributed.is_initialized():
        os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier, which stops every process


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
