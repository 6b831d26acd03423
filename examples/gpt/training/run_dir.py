"""The run directory: what a run writes there, and how an earlier run in it is kept safe.

A directory that holds an earlier run (any of RUN_FILES) is refused, unless --resume
continues that run or --overwrite replaces it. --overwrite deletes nothing up front: the
earlier run's files are moved into ASIDE, inside the directory, and deleted only once
the new run has saved its first checkpoint (or finished). If the new run stops before
that, by an error or Ctrl-C, its files are removed and the earlier run's moved back; a
kill that leaves ASIDE behind is undone the same way when the directory is next opened.
The caller checks every flag and builds the data before it opens the directory.
"""

import os
import shutil
from typing import Callable

from ..config import ConfigError

# What a run writes into its directory; an earlier run is recognised by any of them.
RUN_FILES = ("metrics.jsonl", "config.json", "summary.json", "samples.txt", "report.png",
             "checkpoints", "checkpoints-unusable")
ASIDE = ".replaced-run"  # the earlier run, while an --overwrite has no checkpoint yet


def earlier_run(out_dir: str) -> list[str]:
  """The RUN_FILES that `out_dir` holds."""
  return [name for name in RUN_FILES if os.path.lexists(os.path.join(out_dir, name))]


def _remove(path: str) -> None:
  shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


class RunDir:
  """An opened run directory, with the earlier run set aside by --overwrite (if any)."""

  def __init__(self, out_dir: str, aside: str | None):
    self.out_dir, self.aside = out_dir, aside

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
                 say: Callable[[str], None]) -> RunDir:
  """Makes the run directory, refusing an earlier run unless --resume or --overwrite;
  with --overwrite the earlier run is moved aside, not deleted."""
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
    return RunDir(out_dir, None)
  os.makedirs(aside)
  for name in earlier:
    os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
  return RunDir(out_dir, aside)
