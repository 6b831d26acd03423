"""The run directory: what a run writes there, and how an earlier run in it is kept safe.

A directory that holds an earlier run (any of RUN_FILES) is refused, unless --resume
continues that run or --overwrite replaces it. --overwrite deletes nothing up front: the
earlier run's files are moved into ASIDE, inside the directory, and deleted only once
the new run has saved its first checkpoint (or finished). If the new run stops before
that, by an error or Ctrl-C, its files are removed and the earlier run's moved back; a
kill that leaves ASIDE behind is undone the same way when the directory is next opened.
The caller checks every flag and builds the data before it opens the directory.

The directory belongs to one live run: the process that writes it holds an flock on
LOCK for the whole run, taken before anything else is read, and any other start there
is refused, naming that process. The kernel releases the lock when the process ends, by
any means, so a lock left by a killed run never blocks the next start.
"""

import fcntl
import os
import shutil
import socket
from typing import Callable

from ..config import CONFIG_FILE, ConfigError

# What a run writes into its directory; an earlier run is recognised by any of them.
RUN_FILES = ("metrics.jsonl", CONFIG_FILE, "summary.json", "samples.txt", "report.png",
             "checkpoints", "checkpoints-unusable")
ASIDE = ".replaced-run"  # the earlier run, while an --overwrite has no checkpoint yet
LOCK = ".lock"  # flock-ed by the live run's writing process; holds its host and pid


def earlier_run(out_dir: str) -> list[str]:
  """The RUN_FILES that `out_dir` holds."""
  return [name for name in RUN_FILES if os.path.lexists(os.path.join(out_dir, name))]


def _remove(path: str) -> None:
  shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


class RunLock:
  """The lock of a run directory, held by this process until `release`."""

  def __init__(self, path: str, fd: int, made_dir: bool):
    self.path, self._fd, self._made_dir = path, fd, made_dir

  def release(self) -> None:
    """Removes the lock file, then lets go of it (a start that opened the file before it
    was removed sees that and opens the new one: `lock_run_dir`). A directory that this
    lock made, still empty, goes too."""
    if self._fd is None:
      return
    os.remove(self.path)
    os.close(self._fd)
    self._fd = None
    if self._made_dir:
      try:
        os.rmdir(os.path.dirname(self.path))
      except OSError:  # the run wrote files there: they stay
        pass


def lock_run_dir(out_dir: str) -> RunLock:
  """Makes `out_dir` if needed and takes its lock; refuses, in one line naming the
  process that holds it, a directory that a live run holds."""
  made_dir = not os.path.lexists(out_dir)
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:  # /proc, /sys, a read-only or immutable filesystem
    raise ConfigError(f"--out-dir {out_dir}: the filesystem refuses to make this directory "
                      f"({e.strerror})") from None
  path = os.path.join(out_dir, LOCK)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise ConfigError(f"--out-dir {out_dir}: cannot write its lock file {path} "
                        f"({e.strerror})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder(fd)
      os.close(fd)
      raise ConfigError(f"--out-dir {out_dir} belongs to a live run: {holder} is writing "
                        "it; wait for that run to end, or choose another --out-dir") from None
    except OSError as e:  # a filesystem without locks
      os.close(fd)
      raise ConfigError(f"--out-dir {out_dir}: cannot lock {path} ({e.strerror})") from None
    if _is_file_at(fd, path):
      break
    os.close(fd)  # its holder released and removed it between our open and flock
  os.ftruncate(fd, 0)
  os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
  return RunLock(path, fd, made_dir)


def _holder(fd: int) -> str:
  """Who holds the lock, as its file says: "process PID on host HOST"."""
  words = os.pread(fd, 4096, 0).decode(errors="replace").split()
  if len(words) != 2:
    return "a process that has not yet written its host and pid"
  host, pid = words
  return f"process {pid} on host {host}"


def _is_file_at(fd: int, path: str) -> bool:
  """Whether the open file `fd` is the one that `path` names now."""
  try:
    named = os.stat(path)
  except FileNotFoundError:
    return False
  held = os.fstat(fd)
  return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class RunDir:
  """An opened run directory, with the earlier run set aside by --overwrite (if any), and
  its lock (held by the process that writes the run; None on the others)."""

  def __init__(self, out_dir: str, aside: str | None, lock: RunLock | None = None):
    self.out_dir, self.aside, self.lock = out_dir, aside, lock

  def close(self, failed: bool = False) -> None:
    """The run is over: the run it replaced is put back if it `failed` before its first
    checkpoint, else deleted; the lock is released last."""
    try:
      self.restore_earlier() if failed else self.keep_new()
    finally:
      if self.lock is not None:
        self.lock.release()
        self.lock = None

  def keep_new(self) -> None:
    """The new run has a checkpoint: the earlier run it replaces is deleted."""
    if self.aside is not None:
      shutil.rmtree(self.aside)
      self.aside = None

  def restore_earlier(self) -> None:
    """The new run stopped before its first checkpoint: its files are removed and the
    earlier run's moved back (nothing to do without --overwrite)."""
    if self.aside is not None:
      _restore(self.out_dir, self.aside)
      self.aside = None


def _restore(out_dir: str, aside: str) -> None:
  """Puts the run in `aside` back into `out_dir`. Safe to repeat after a kill: `aside`
  goes last, so while it exists its files are the ones that count."""
  for name in RUN_FILES:
    if os.path.lexists(os.path.join(out_dir, name)):
      _remove(os.path.join(out_dir, name))
  for name in os.listdir(aside):
    os.replace(os.path.join(aside, name), os.path.join(out_dir, name))
  os.rmdir(aside)


def open_run_dir(out_dir: str, *, resume: bool, overwrite: bool,
                 say: Callable[[str], None], lock: RunLock | None = None) -> RunDir:
  """Makes the run directory, refusing an earlier run unless --resume or --overwrite;
  with --overwrite the earlier run is moved aside, not deleted. `lock`: the directory's,
  held by the caller, which the RunDir then releases."""
  aside = os.path.join(out_dir, ASIDE)
  if os.path.isdir(aside):
    _restore(out_dir, aside)
    say(f"{out_dir}: restored the earlier run that an --overwrite had set aside (the new "
        "run stopped before its first checkpoint)")
  earlier = earlier_run(out_dir)
  if earlier and not (resume or overwrite):
    raise ConfigError(
        f"--out-dir {out_dir} holds an earlier run ({', '.join(earlier)}): pass "
        "--resume to continue it or --overwrite to replace it")
  os.makedirs(out_dir, exist_ok=True)
  if not (overwrite and earlier):
    return RunDir(out_dir, None, lock)
  os.makedirs(aside)
  for name in earlier:
    os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
  return RunDir(out_dir, aside, lock)
