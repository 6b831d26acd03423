"""Status lines for the steps of a run that take more than a few seconds.

    with status.timed("reading the sources"):
      ...

prints "reading the sources ..." before the step and "reading the sources: 3.2 s" after
it, so a long wait (the corpus, the tokenizer, the first compile) is never silent.
"""

import contextlib
import time
from typing import Callable


def say(message: str) -> None:
  print(message, flush=True)


@contextlib.contextmanager
def timed(what: str, log: Callable[[str], None] = say):
  log(f"{what} ...")
  start = time.perf_counter()
  yield
  log(f"{what}: {time.perf_counter() - start:.1f} s")
