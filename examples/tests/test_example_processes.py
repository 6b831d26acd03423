"""The example as one program on several processes (distributed.py), on the CPU: 2
processes of 4 devices each, joined over localhost with --coordinator, --num-processes and
--process-id, their collectives over gloo.

- On meshes data=2,fsdp=4 and fsdp=8 they compute the losses of one process with 8
  devices (relative difference < 1e-5); only process 0 writes the run's files.
- A run resumes across process counts: 2 x 4 to 1 x 8, and 1 x 8 to 2 x 4.
- SIGTERM to one process stops all of them after the same step, with a checkpoint.
- A process killed outright (SIGKILL) ends the other within the heartbeat timeout
  (HEARTBEAT_S here), with an error that says so.

Each run is its own train_gpt.py processes, so those tests are marked slow.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gpt import config, flags
from gpt.reports import metrics
from gpt.training import distributed
from examples.tests.conftest import EXAMPLES

STEPS, STOP = 20, 10
RTOL = 1e-5
HEARTBEAT_S = 10
# A kill is noticed within the heartbeat timeout; the rest is the survivor's shutdown.
KILL_BOUND_S = HEARTBEAT_S + 30
RUN_TIMEOUT_S = 600
# What a process prints when another one dies: JAX's coordination service (missing
# heartbeats, or the service's own process gone), or gloo meeting the closed connection
# in a collective (an exception, or an abort from gloo's checks on the half-received data).
PEER_GONE = ("stopped sending heartbeats|another task died|Connection closed by peer"
             "|Connection reset by peer|gloo::")
TINY = ["--config", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--context-length",
        "32", "--vocab-size", "512", "--max-source-mb", "0.05", "--peak-lr", "1e-3",
        "--warmup-steps", "3", "--seed", "1", "--checkpoint-every", str(STOP),
        "--num-samples", "1", "--sample-tokens", "4", "--no-progress"]



def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start(processes: int, out_dir, cache_dir, *args) -> list[subprocess.Popen]:
  """train_gpt.py as `processes` processes of 8 // processes CPU devices each."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") +
      f" --xla_force_host_platform_device_count={8 // processes}").strip())
  argv = [sys.executable, str(EXAMPLES / "train_gpt.py"), *TINY, "--out-dir", str(out_dir),
          "--cache-dir", cache_dir, *args]
  if processes > 1:
    argv += ["--coordinator", f"localhost:{_free_port()}", "--num-processes",
             str(processes), "--heartbeat-timeout-s", str(HEARTBEAT_S)]
  return [subprocess.Popen(argv + (["--process-id", str(i)] if processes > 1 else []),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True) for i in range(processes)]


def finish(procs) -> list[str]:
  """The processes' outputs; fails unless every one exits with 0."""
  outputs = []
  try:
    outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for i, (p, output) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{output[-8000:]}"
  return outputs


def train(processes: int, out_dir, cache_dir, *args) -> list[float]:
  """Runs to the end; the losses of every step in the run directory's metrics.jsonl."""
  finish(start(processes, out_dir, cache_dir, *args))
  return losses(out_dir)


def losses(out_dir) -> list[float]:
  records = metrics.read_records(str(out_dir / "metrics.jsonl"))
  return [r["loss"] for r in metrics.step_records(records)]


# --- Launch: what is decided before JAX starts ------------------------------------------


def test_a_single_process_joins_nothing(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", *distributed.ENV.values()):
    monkeypatch.delenv(var, raising=False)
  assert distributed.cluster_process_count() == 1  # no SLURM, Open MPI, TPU pod here
  distributed.launch()
  distributed.launch(num_processes=1, process_id=0)  # one process asked for: the same
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("env, kwargs, message", [
    ({"JAX_NUM_PROCESSES": "two"}, {}, "JAX_NUM_PROCESSES='two': expected a number"),
    ({}, {"heartbeat_timeout_s": 0}, "--heartbeat-timeout-s must be >= 1, got 0"),
])
def test_bad_launch_settings_are_named(monkeypatch, env, kwargs, message):
  for var, value in env.items():
    monkeypatch.setenv(var, value)
  with pytest.raises(config.ConfigError, match=message):
    distributed.launch(**kwargs)
  assert not jax.distributed.is_initialized()


def test_the_launch_flags():
  cfg = flags.parse_args(["--coordinator", "host:1234", "--num-processes", "2",
                           "--process-id", "1", "--heartbeat-timeout-s", "30"])[1]
  assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.heartbeat_timeout_s) == (
      "host:1234", 2, 1, 30)


# --- Runs of 2 processes of 4 devices -------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> list[float]:
  """One process of 8 devices, every device on the data axis."""
  return train(1, tmp_path_factory.mktemp("one-process") / "run", cache_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=2,fsdp=4", "fsdp=8"])
def test_two_processes_train_as_one(reference, tmp_path, cache_dir, mesh):
  out = tmp_path / "run"
  outputs = finish(start(2, out, cache_dir, "--mesh", mesh))
  np.testing.assert_allclose(losses(out), reference, rtol=RTOL)
  assert len(reference) == STEPS
  # Process 0 wrote the files, once; process 1 printed nothing of the run.
  assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "metrics.jsonl",
                                     "report.png", "samples.txt", "summary.json"]
  summary = json.loads((out / "summary.json").read_text())
  assert len(summary["peak_device_memory_bytes_by_process"]) == 2
  assert min(summary["peak_device_memory_bytes_by_process"]) > 0
  assert all(len(r["device_memory_bytes"]) == 4
             for r in metrics.step_records(metrics.read_records(str(out / "metrics.jsonl"))))
  assert "in 2 processes" in outputs[0] and "loss " in outputs[0]
  assert "phase 0" not in outputs[1] and "loss " not in outputs[1]


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_process_count(reference, tmp_path, cache_dir, first, then):
  out = tmp_path / "run"
  head = train(first, out, cache_dir, "--mesh", "data=2,fsdp=4", "--stop-after-step",
               str(STOP))
  np.testing.assert_allclose(head, reference[:STOP], rtol=RTOL)
  whole = train(then, out, cache_dir, "--mesh", "fsdp=8", "--resume")
  assert len(whole) == STEPS
  np.testing.assert_allclose(whole, reference, rtol=RTOL)


def _wait_for_steps(out_dir, count: int, procs) -> None:
  deadline = time.monotonic() + RUN_TIMEOUT_S
  while time.monotonic() < deadline:
    if (out_dir / "metrics.jsonl").exists() and len(losses(out_dir)) >= count:
      return
    if any(p.poll() is not None for p in procs):
      pytest.fail("a process ended early:\n" + procs[0].communicate()[0][-4000:])
    time.sleep(0.5)
  pytest.fail(f"no {count} steps within {RUN_TIMEOUT_S} s")


def _outputs_within(procs, seconds: float) -> list[str]:
  try:
    return [p.communicate(timeout=seconds)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_stops_every_process_after_a_checkpoint(tmp_path, cache_dir, processes):
  """SIGTERM to one process (the last): every process saves the same step and stops
  with one line saying so; --resume continues from there."""
  out = tmp_path / "run"
  procs = start(processes, out, cache_dir, "--steps", "100000", "--checkpoint-every",
                "100000")
  _wait_for_steps(out, 3, procs)
  procs[-1].send_signal(signal.SIGTERM)
  outputs = _outputs_within(procs, KILL_BOUND_S)
  stopped = [re.search(r"SIGTERM: stopped after step (\d+) of 100000, saved in", o)
             for o in outputs]
  assert all(stopped), outputs[-1][-4000:]
  step = int(stopped[0][1])
  assert {int(m[1]) for m in stopped} == {step}
  assert all(p.returncode == 1 for p in procs)
  assert os.listdir(out / "checkpoints") == [str(step)]
  assert len(losses(out)) == step


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_stops_the_other_with_a_clear_error(tmp_path, cache_dir, victim):
  """SIGKILL of one process: the other ends within the heartbeat timeout, with an error
  that says a peer is gone. (Process 0 runs JAX's coordination service: when it dies,
  process 1 learns of it as soon as the service's socket closes; when process 1 dies, the
  service notices its missing heartbeats. Either may first meet the dead peer in a
  collective: gloo then ends the process with its own message.)"""
  out = tmp_path / "run"
  procs = start(2, out, cache_dir, "--steps", "100000", "--checkpoint-every", "100000")
  _wait_for_steps(out, 3, procs)
  procs[victim].send_signal(signal.SIGKILL)
  killed_at = time.monotonic()
  survivor = procs[1 - victim]
  output = _outputs_within([survivor], KILL_BOUND_S + 60)[0]
  took = time.monotonic() - killed_at
  procs[victim].wait(timeout=60)
  assert survivor.returncode != 0
  assert took < KILL_BOUND_S, f"process {1 - victim} took {took:.0f} s:\n{output[-4000:]}"
  assert re.search(PEER_GONE, output), output[-4000:]
