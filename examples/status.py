"""Status lines for the steps of a run that take more than a few seconds.

    with status.timed("reading the sources"):
      ...

prints "reading the sources ..." before the step and "reading the sources: 3.2 s" after
it, so a long wait (the corpus, the tokenizer, the first compile) is never silent. In a
run of several processes only process 0 prints them (distributed.launch).
"""

import contextlib
import time
from typing import Callable


_speaking = True


def speak(on: bool) -> None:
  """Whether this process prints status lines."""
  global _speaking
  _speaking = on


def say(message: str) -> None:
  if _speaking:
    print(message, flush=True)


@contextlib.contextmanager
def timed(what: str, log: Callable[[str], None] = say):
  log(f"{what} ...")
  start = time.perf_counter()
  yield
  log(f"{what}: {time.perf_counter() - start:.1f} s")
