"""What the example's tests share: one tokenizer cache and one compilation cache for the
session, the tiny settings most tests start from, and runs of a test file on N forced CPU
devices. The example's package and its experiments are found through pyproject.toml's
`pythonpath`."""

import os
import pathlib

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache
from watched import run_pytest_on_cpu_devices

from gpt import config

EXAMPLES = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
  """One tokenizer cache for every test: each corpus trains its tokenizer once."""
  return str(tmp_path_factory.mktemp("tokenizer-cache"))


# JAX's persistent compilation cache, for this session's tests and their subprocesses: the
# tests train the same tiny step many times, and each fresh jit of it would compile anew.
# A size limit makes JAX lock the cache while it reads or writes an entry, since pytest-xdist's
# workers share it. Compiles shorter than a quarter second (single ops run eagerly, small
# functions: thousands in a session) are quicker to redo than to write and lock; the
# training step's compile is several times longer.
_COMPILE_CACHE = {"jax_compilation_cache_dir": None,
                  "jax_persistent_cache_min_compile_time_secs": 0.25,
                  "jax_persistent_cache_min_entry_size_bytes": 0,
                  "jax_compilation_cache_max_size": 8 << 30}


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
  """One cache for the session's workers. The cache's directory is part of JAX's cache keys
  (it enters the compile options), so each worker's own would share nothing."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the session's directory; each worker's is below it
  (root / "compile-cache").mkdir(exist_ok=True)
  settings = {**_COMPILE_CACHE, "jax_compilation_cache_dir": str(root / "compile-cache")}
  before = {name: getattr(jax.config, name) for name in settings}
  for name, value in settings.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()  # JAX reads the settings once, at its first compile
  os.environ.update({name.upper(): str(value) for name, value in settings.items()})
  yield settings["jax_compilation_cache_dir"]
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  for name in settings:
    os.environ.pop(name.upper(), None)


@pytest.fixture(scope="session")
def tiny(cache_dir):
  """tiny(out_dir, **overrides): the tiny model on a small vocabulary, short context and
  few steps, with no samples, plot or progress bar unless asked for."""

  def make(out_dir, **overrides) -> config.TrainConfig:
    settings = dict(
        config="tiny", steps=20, batch_size=8, context_length=32, vocab_size=512,
        peak_lr=3e-3, warmup_steps=3, max_source_mb=0.05, checkpoint_every=1000,
        out_dir=str(out_dir), cache_dir=cache_dir, num_samples=0, plot=False,
        progress=False)
    return config.TrainConfig(**{**settings, **overrides})

  return make


# Set in a subprocess that runs a test file on N forced CPU devices: N.
DEVICES_ENV = "CLIPJAX_EXAMPLE_CPU_DEVICES"


def run_file_on_cpu_devices(test_file, count: int, env: dict | None = None) -> None:
  """Runs `test_file` with pytest in a subprocess on `count` CPU devices (XLA fixes the
  CPU device count when its backend starts, so it cannot change within this process);
  `env` is added to its environment. Fails with the subprocess's output if it fails or
  runs no test."""
  run = run_pytest_on_cpu_devices(test_file, count, {**(env or {}), DEVICES_ENV: str(count)})
  assert " passed" in run.stdout, f"no test ran on {count} devices:\n{run.stdout[-4000:]}"


def devices_here() -> int | None:
  """N inside a subprocess of run_file_on_cpu_devices, else None."""
  count = os.environ.get(DEVICES_ENV)
  return int(count) if count else None


def require_repeatable_bits() -> None:
  """Skips a test that compares two runs bit for bit where they may differ: on a GPU,
  XLA's scatter-adds (the embeddings' gradients) add in whatever order their threads
  come, unless its deterministic ops are on. A CPU runs them in one order."""
  if (jax.default_backend() == "gpu"
      and "--xla_gpu_deterministic_ops=true" not in os.environ.get("XLA_FLAGS", "")):
    pytest.skip("two runs on a GPU give the same bits only with "
                "XLA_FLAGS=--xla_gpu_deterministic_ops=true")
