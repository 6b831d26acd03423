"""The run directory belongs to its run, as a user at a second terminal finds it:

- a live run holds the directory's lock: every other start there (plain, --overwrite,
  --resume) is refused in one line naming the live process, and the run goes on;
- Ctrl-C stops a run as SIGTERM does: the step finishes, a checkpoint is saved (or the run
  an --overwrite replaced is put back), one line, exit status 130; a second Ctrl-C exits
  at once, and the next start continues from the last checkpoint; in a run of two
  processes a Ctrl-C to one stops both after the same step (slow);
- a lock left by a killed process never blocks;
- `--resume --out-dir X` alone takes the run's settings from X/config.json;
- --stop-after-step ends with a line saying that --resume continues the run.

Each case runs train_gpt.py as its own process on the CPU, with the tiny settings below,
and compares the run directory's contents before and after where it must not change.
"""

import dataclasses
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from gpt import config, flags
from gpt.training import loop
from gpt.reports import metrics
from gpt.training import run_dir as run_dir_lib
import train_gpt
from examples.tests import test_example_processes as processes
from examples.tests.conftest import EXAMPLES
from examples.tests.test_example_keeps_runs import contents

TINY = ["--config", "tiny", "--batch-size", "8", "--context-length", "32", "--vocab-size",
        "512", "--max-source-mb", "0.05", "--peak-lr", "1e-3", "--warmup-steps", "3",
        "--num-samples", "0", "--no-plot", "--no-progress"]
# A run that lasts until it is stopped, its metrics written at every step.
ENDLESS = ["--steps", "100000", "--checkpoint-every", "100000", "--log-every", "1"]
TIMEOUT_S = 300
TRACEBACK = "Traceback (most recent call last)"


def start(*args) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return subprocess.Popen([sys.executable, str(EXAMPLES / "train_gpt.py"), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(*args) -> subprocess.CompletedProcess:
  proc = start(*args)
  output = finish(proc)
  return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> str:
  try:
    return proc.communicate(timeout=timeout)[0]
  finally:
    proc.kill()


def steps_logged(out_dir) -> int:
  path = out_dir / "metrics.jsonl"
  return len(metrics.step_records(metrics.read_records(str(path)))) if path.exists() else 0


def wait_for_steps(proc, out_dir, count: int, aside: bool = False) -> None:
  """Waits until `out_dir` logs `count` steps (of a run that set an earlier one aside)."""
  deadline = time.monotonic() + TIMEOUT_S
  while steps_logged(out_dir) < count or (out_dir / run_dir_lib.ASIDE).is_dir() != aside:
    if proc.poll() is not None:
      pytest.fail(f"the run ended early:\n{proc.communicate()[0][-4000:]}")
    if time.monotonic() > deadline:
      pytest.fail(f"no {count} steps within {TIMEOUT_S} s")
    time.sleep(0.2)


def last_line(output: str) -> str:
  return output.rstrip("\n").splitlines()[-1]


def test_a_live_run_refuses_every_other_start_and_ctrl_c_stops_it(tmp_path, cache_dir, tiny):
  out = tmp_path / "run"
  live = start(*TINY, *ENDLESS, "--out-dir", str(out), "--cache-dir", cache_dir)
  wait_for_steps(live, out, 2)
  refusal = (f"--out-dir {out} belongs to a live run: process {live.pid} on host "
             f"{socket.gethostname()} is writing it; wait for that run to end, or choose "
             "another --out-dir")
  second = run(*TINY, "--steps", "6", "--out-dir", str(out), "--cache-dir", cache_dir)
  assert second.returncode == 2, second.stdout[-4000:]
  assert last_line(second.stdout) == f"train_gpt.py: error: {refusal}"
  assert TRACEBACK not in second.stdout
  for kind in ({}, {"overwrite": True}, {"resume": True}):  # the same, from Python
    with pytest.raises(config.ConfigError, match=f"^{re.escape(refusal)}$"):
      loop.train(tiny(out, **kind))
  assert live.poll() is None  # the live run goes on, its files its own
  at_ctrl_c = steps_logged(out)
  live.send_signal(signal.SIGINT)
  output = finish(live)
  stopped = re.fullmatch(r"train_gpt.py: Ctrl-C: stopped after step (\d+) of 100000, saved "
                         rf"in {out / 'checkpoints'}; --resume continues the run",
                         last_line(output))
  assert stopped, output[-4000:]
  assert live.returncode == 130 and TRACEBACK not in output
  step = int(stopped[1])
  assert step >= at_ctrl_c
  assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert os.listdir(out / "checkpoints") == [str(step)] and steps_logged(out) == step


@pytest.fixture
def finished(tmp_path, tiny):
  """(directory, contents) of a finished run of 4 steps."""
  out = tmp_path / "run"
  loop.train(tiny(out, steps=4, checkpoint_every=2))
  return out, contents(out)


def test_ctrl_c_before_an_overwrites_first_checkpoint_puts_the_run_back(finished, cache_dir):
  out, before = finished
  new = start(*TINY, *ENDLESS, "--out-dir", str(out), "--cache-dir", cache_dir, "--overwrite")
  wait_for_steps(new, out, 2, aside=True)  # the new run's steps; the earlier run aside
  new.send_signal(signal.SIGINT)
  output = finish(new)
  assert re.fullmatch(r"train_gpt.py: Ctrl-C: stopped after step \d+ of 100000, before this "
                      rf"--overwrite's first checkpoint: the run it replaced is back in {out}",
                      last_line(output)), output[-4000:]
  assert new.returncode == 130 and TRACEBACK not in output
  assert contents(out) == before


def test_a_second_ctrl_c_exits_at_once_and_the_next_start_continues(tmp_path, cache_dir):
  out = tmp_path / "run"
  live = start(*TINY, *ENDLESS, "--checkpoint-every", "2", "--out-dir", str(out),
               "--cache-dir", cache_dir)
  wait_for_steps(live, out, 4)
  live.send_signal(signal.SIGINT)
  time.sleep(0.05)
  live.send_signal(signal.SIGINT)
  sent = time.monotonic()
  output = finish(live)
  assert time.monotonic() - sent < 10
  assert live.returncode == 130 and TRACEBACK not in output, output[-4000:]
  assert last_line(output).startswith(("second Ctrl-C: exiting at once",
                                       "train_gpt.py: Ctrl-C: stopped after step"))
  # Whatever the second Ctrl-C cut short, the next start continues from a checkpoint.
  until = steps_logged(out) + 2
  resumed = run("--resume", "--out-dir", str(out), "--stop-after-step", str(until))
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  assert "; resumed after step " in resumed.stdout
  assert steps_logged(out) == until


def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
  out = tmp_path / "run"
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from gpt.training import run_dir; "
       "run_dir.lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(600)",
       str(out)], stdout=subprocess.PIPE, text=True,
      env={**os.environ, "PYTHONPATH": str(EXAMPLES)})
  try:
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(run_dir_lib.ConfigError, match=rf"process {holder.pid} on host "):
      run_dir_lib.lock_run_dir(str(out))
  finally:
    holder.kill()  # SIGKILL: the lock file stays, naming a process that is gone
    holder.wait()
  assert (out / run_dir_lib.LOCK).read_text().split()[1] == str(holder.pid)
  lock = run_dir_lib.lock_run_dir(str(out))
  assert (out / run_dir_lib.LOCK).read_text() == f"{socket.gethostname()} {os.getpid()}\n"
  lock.release()
  assert os.listdir(out) == []


def test_one_process_holds_the_lock_until_it_releases_it(tmp_path):
  run_dir_lib.lock_run_dir(str(tmp_path / "new")).release()
  assert not (tmp_path / "new").exists()  # a start that wrote nothing leaves nothing
  out = tmp_path / "run"
  first = run_dir_lib.lock_run_dir(str(out))
  with pytest.raises(run_dir_lib.ConfigError, match=(
      rf"^--out-dir {out} belongs to a live run: process {os.getpid()} on host "
      rf"{re.escape(socket.gethostname())} is writing it; wait for that run to end, or "
      r"choose another --out-dir$")):
    run_dir_lib.lock_run_dir(str(out))
  (out / "metrics.jsonl").write_text("")
  first.release()
  assert os.listdir(out) == ["metrics.jsonl"]  # a run's files stay, the lock goes
  with open(out / run_dir_lib.LOCK, "w") as f:  # a start that opened the old file, which
    fcntl.flock(f, fcntl.LOCK_EX)  # a release removed: it holds no lock on the new one
    os.remove(out / run_dir_lib.LOCK)
    run_dir_lib.lock_run_dir(str(out)).release()


def test_a_resume_takes_the_runs_settings_from_its_directory(tmp_path, cache_dir, capsys):
  out = tmp_path / "run"
  head = run(*TINY, "--steps", "6", "--checkpoint-every", "2", "--seed", "3", "--out-dir",
             str(out), "--cache-dir", cache_dir, "--stop-after-step", "3")
  assert head.returncode == 0, head.stdout[-4000:]
  assert last_line(head.stdout) == (
      f"--stop-after-step 3: stopped after step 3 of 6, saved in {out / 'checkpoints'}; "
      "--resume continues the run")
  first = json.loads((out / "config.json").read_text())
  before = contents(out)
  with pytest.raises(SystemExit) as refused:  # a flag that changes the losses
    train_gpt.main(["--resume", "--out-dir", str(out), "--seed", "4"])
  assert refused.value.code == 2
  assert last_line(capsys.readouterr().err).endswith(
      "was made with other settings: seed=3 (now 4)")
  assert contents(out) == before  # refused as before: nothing moved
  rest = run("--resume", "--out-dir", str(out))
  assert rest.returncode == 0, rest.stdout[-4000:]
  assert "; resumed after step 3" in rest.stdout
  assert steps_logged(out) == 6 and (out / "summary.json").exists()
  now = json.loads((out / "config.json").read_text())
  assert {k for k in first if first[k] != now[k]} == {"resume", "stop_after_step"}


def test_a_resumes_flags_outside_the_step_apply_to_it(tmp_path, capsys):
  saved = config.TrainConfig(config="tiny", steps=6, batch_size=8, context_length=32,
                             log_every=1, num_samples=0, seed=3, sources=("gutenberg=a",),
                             time_limit_s=60.0, stop_after_step=3, out_dir=str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
  resumed = flags.parse_args(["--resume", "--out-dir", str(tmp_path), "--log-every", "10",
                               "--num-samples", "2", "--bandit-eta", "2"])[1]
  assert resumed == dataclasses.replace(
      saved, resume=True, log_every=10, num_samples=2, time_limit_s=None,
      stop_after_step=None, bandit_config=dataclasses.replace(saved.bandit_config, eta=2.0))
  (tmp_path / "config.json").write_text("{")
  with pytest.raises(SystemExit):
    flags.parse_args(["--resume", "--out-dir", str(tmp_path)])
  assert f"error: --resume: cannot read the run's settings from {tmp_path}/config.json (" \
      in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_to_one_of_two_processes_stops_both_after_one_step(tmp_path, cache_dir):
  """A Ctrl-C to one process of two is handed to JAX's preemption notifier as SIGTERM:
  both save the same step and stop, the interrupted one with status 130."""
  out = tmp_path / "run"
  procs = processes.start(2, out, cache_dir, "--steps", "100000", "--checkpoint-every",
                          "100000")
  processes._wait_for_steps(out, 3, procs)
  procs[-1].send_signal(signal.SIGINT)
  outputs = processes._outputs_within(procs, processes.KILL_BOUND_S)
  stopped = [re.search(r"(SIGTERM|Ctrl-C): stopped after step (\d+) of 100000, saved in",
                       output) for output in outputs]
  assert all(stopped), outputs[-1][-4000:]
  assert [m[1] for m in stopped] == ["SIGTERM", "Ctrl-C"]
  assert len({m[2] for m in stopped}) == 1
  assert [p.returncode for p in procs] == [1, 130]
  assert os.listdir(out / "checkpoints") == [stopped[0][2]]
