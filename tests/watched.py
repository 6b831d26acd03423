"""Subprocesses of the tests, ended when they stop making progress, not at a wall time:
a loaded machine makes a run slow, not wrong, and a hung one still fails."""

import os
import subprocess
import sys
import threading
import time

import pytest

# A subprocess that prints nothing for this long is taken to be hung.
QUIET_LIMIT_S = 1800.0


def run_watched(cmd, *, quiet_limit_s: float = QUIET_LIMIT_S, **popen_kwargs
                ) -> subprocess.CompletedProcess:
  """Runs `cmd` with its stdout and stderr read together (as `.stdout`; `.stderr` is "").

  It may run as long as it keeps printing: only after `quiet_limit_s` seconds without a
  byte of output is it killed, and the calling test fails naming the command, the silence
  and the output's end. Run pytest with -v, so that each test prints a line.
  """
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, **popen_kwargs)
  chunks, last_output = [], [time.monotonic()]

  def read() -> None:
    while chunk := proc.stdout.read1(65536):
      chunks.append(chunk)
      last_output[0] = time.monotonic()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  while proc.poll() is None:
    if time.monotonic() - last_output[0] > quiet_limit_s:
      proc.kill()
      proc.wait()
      reader.join()
      tail = b"".join(chunks).decode(errors="replace")[-6000:]
      pytest.fail(f"{' '.join(map(str, cmd))} printed nothing for {quiet_limit_s:g} s and "
                  f"was ended; its output ended with:\n{tail}")
    reader.join(timeout=1.0)
  reader.join()
  return subprocess.CompletedProcess(cmd, proc.returncode,
                                     b"".join(chunks).decode(errors="replace"), "")


def run_pytest_on_cpu_devices(test_file, count: int, env: dict) -> subprocess.CompletedProcess:
  """Runs `test_file` with pytest (-v, without the fuzz) in a watched subprocess on `count`
  forced CPU devices (XLA fixes the CPU device count when its backend starts, so it
  cannot change within a process); `env` is added to its environment. Fails with the
  subprocess's output if it fails."""
  flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
  env = dict(os.environ, **env, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  run = run_watched([sys.executable, "-m", "pytest", "-v", "-m", "not fuzz", "-p",
                     "no:cacheprovider", str(test_file)], env=env)
  assert run.returncode == 0, run.stdout[-12000:]
  return run
