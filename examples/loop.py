"""The training loop: the data, the model and the run directory, then the steps in order.

`train(cfg)` runs (or resumes) a run and returns every metrics record of it so far:

  make_mesh      the device mesh (--mesh) and the batch sharding
  load_data      the sources (held-out text split off), the tokenizer, the token streams
  init_model     the GPT's graph and initial parameters, sharded on the mesh
  open_run_dir   only then, the run directory (run_dir.py): an earlier run is refused
                 unless --resume, and set aside, not deleted, by --overwrite
  restore        on --resume, the latest usable checkpoint of the same settings
  run_steps      phases and the bandit, the jitted step, the metrics log, checkpoints
  report         summary.json, report.png and samples.txt, once the last step is done

The metrics of step s are fetched from the device while step s + 1 runs (`fetch_pending`),
so the host does not wait for the accelerator between steps.
"""

import bisect
import contextlib
import dataclasses
import os
import time
from typing import Any, Callable

import clipjax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import bandit
import checkpoint
import corpus
import metrics
import model as model_lib
import pipeline
import report
import run_dir as run_dir_lib
import sharding
import status
import tokenizer as tokenizer_lib
import train_step as train_step_lib
from config import RUN_IDENTITY, ConfigError, TrainConfig, resolve

# Errors in what the user gave: a flag, a source, the run directory. One line, no traceback.
USER_ERRORS = (ConfigError, corpus.SourceError, checkpoint.CheckpointError,
               sharding.MeshError)


class TrainingDiverged(Exception):
  """The loss or the gradient norm stayed NaN/inf for --nonfinite-stop steps in a row."""


@dataclasses.dataclass(frozen=True)
class Data:
  streams: list[np.ndarray]  # one int32 token stream per source, in SOURCE_NAMES order
  tokenizer: Any
  corpus_key: str  # a hash of the training text and the vocabulary size
  prompts: list[str]  # the sample prompts: --prompt, else cut from the held-out text


@dataclasses.dataclass
class State:
  """What changes from step to step."""
  params: Any
  opt_state: Any
  bandit: bandit.BanditState
  step_done: int  # the last step whose update is in params
  pending: tuple | None = None  # (step, phase, device metrics) not yet fetched
  last_time: float = 0.0  # when the previous step's metrics were fetched
  nonfinite_steps: list[int] = dataclasses.field(default_factory=list)  # the latest run


@dataclasses.dataclass(frozen=True)
class Loop:
  """What the steps of one run share."""
  cfg: TrainConfig
  mesh: Any  # jax.sharding.Mesh
  train_step: Callable
  prefetcher: pipeline.Prefetcher
  checkpoints: checkpoint.RunCheckpoints
  run_dir: run_dir_lib.RunDir
  log: metrics.MetricsLog
  say: Callable[[str], None]  # one line, above the progress bar
  bar: tqdm
  identity: dict  # the settings a resume must share, saved in every checkpoint
  phase_starts: list[int]
  last_step: int
  started: float
  leaf_names: list[str]  # the paths of the clip state's leaf norms ([] without a clip)


def train(cfg: TrainConfig) -> list[dict]:
  """Runs (or resumes) training; returns every metrics record of the run so far."""
  cfg = resolve(cfg)
  started = time.perf_counter()
  mesh = make_mesh(cfg)
  data = load_data(cfg)
  graphdef, params = init_model(cfg, mesh)
  tx = train_step_lib.make_optimizer(cfg)
  opt_state = init_opt_state(tx, params, mesh)
  train_step = train_step_lib.make_train_step(graphdef, tx, cfg, len(corpus.SOURCE_NAMES),
                                              mesh, params, opt_state)
  run_dir = run_dir_lib.open_run_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite,
                                     say=status.say)
  try:
    records = _run_in_dir(cfg, run_dir, started, mesh, data, graphdef, params, opt_state,
                          train_step)
  except BaseException:
    run_dir.restore_earlier()  # the new run has no checkpoint: the one it replaced stays
    raise
  run_dir.keep_new()
  return records


def _run_in_dir(cfg, run_dir, started, mesh, data, graphdef, params, opt_state, train_step):
  """The run itself, once its directory is open: restore, steps, checkpoints, report."""
  checkpoints = checkpoint.RunCheckpoints(os.path.join(cfg.out_dir, "checkpoints"),
                                          fresh=not cfg.resume, keep=cfg.keep_checkpoints)
  identity = {k: v for k, v in dataclasses.asdict(cfg).items() if k in RUN_IDENTITY}
  identity["corpus"] = data.corpus_key
  state = restore(cfg, checkpoints, params, opt_state, identity)
  log = open_metrics_log(cfg, state.step_done)
  metrics.write_json_atomic(os.path.join(cfg.out_dir, "config.json"), dataclasses.asdict(cfg))
  last_step = cfg.stop_after_step or cfg.steps
  bar = tqdm(total=last_step, initial=state.step_done, disable=not cfg.progress,
             desc=f"{cfg.config} {cfg.recipe}", dynamic_ncols=True)
  loop = Loop(
      cfg=cfg, mesh=mesh, train_step=train_step,
      prefetcher=pipeline.Prefetcher(data.streams, seed=cfg.seed, batch_size=cfg.batch_size,
                                     context_length=cfg.context_length,
                                     sharding=sharding.batch_sharding(mesh)),
      checkpoints=checkpoints, run_dir=run_dir, log=log,
      say=bar.write if cfg.progress else status.say,
      bar=bar, identity=identity, phase_starts=bandit.phase_starts(cfg.seed, cfg.steps),
      last_step=last_step, started=started,
      leaf_names=list(clipjax.named_leaf_norms(opt_state, params)) if cfg.max_norm > 0 else [])
  loop.say(describe_start(cfg, mesh, state))
  try:
    stopped_at = run_steps(loop, state)
  finally:
    loop.prefetcher.close()
    checkpoints.close()
    log.close()
    bar.close()
  if last_step == cfg.steps:
    report.write_report(cfg, log.records, graphdef, state.params, data.tokenizer,
                        data.prompts, started, stopped_at)
  return log.records


# --- Before the first step --------------------------------------------------------


def load_data(cfg: TrainConfig) -> Data:
  with status.timed("reading the sources"):
    texts = corpus.load_corpus(corpus.parse_source_flags(cfg.sources),
                               int(cfg.max_source_mb * 2**20))
  split = {name: corpus.split_held_out(docs) for name, docs in texts.items()}
  train_texts = {name: train for name, (train, _) in split.items()}
  held_out = {name: held for name, (_, held) in split.items()}
  tokenizer, streams, corpus_key = tokenizer_lib.load_tokenizer_and_streams(
      train_texts, cfg.vocab_size, cfg.cache_dir)
  for name in corpus.SOURCE_NAMES:
    if len(streams[name]) <= cfg.context_length:
      raise corpus.SourceError(
          f"source {name!r} has {len(streams[name])} tokens of training text; a batch row "
          f"needs --context-length + 1 = {cfg.context_length + 1}")
  prompts = list(cfg.prompts) or corpus.held_out_prompts(held_out, cfg.num_samples)
  return Data([streams[name] for name in corpus.SOURCE_NAMES], tokenizer, corpus_key,
              prompts)


def make_mesh(cfg: TrainConfig):
  """The --mesh of the visible devices; the global batch must split over all of them."""
  mesh = sharding.make_mesh(cfg.mesh)
  if cfg.batch_size % mesh.size:
    raise ConfigError(f"--batch-size {cfg.batch_size} does not split over the {mesh.size} "
                      f"devices of the mesh ({sharding.describe(mesh)})")
  return mesh


def init_model(cfg: TrainConfig, mesh=None):
  """(graphdef, params): the model's structure and its initial parameters (a pure dict),
  placed on the mesh's fsdp shardings when one is given. The values do not depend on
  the mesh."""
  model_cfg = dataclasses.replace(
      model_lib.MODEL_CONFIGS[cfg.config], vocab_size=cfg.vocab_size,
      context_length=cfg.context_length, dtype=cfg.dtype)
  graphdef, state = nnx.split(model_lib.GPT(model_cfg, nnx.Rngs(cfg.seed)))
  params = nnx.to_pure_dict(state)
  if mesh is not None:
    params = jax.device_put(params, sharding.state_shardings(mesh, params))
  return graphdef, params


def init_opt_state(tx, params, mesh):
  """The optimizer's initial state, made on each device's shards (sharded like the
  parameters leaf by leaf: AdamW's moments have their shapes)."""
  shapes = jax.eval_shape(tx.init, params)
  return jax.jit(tx.init, out_shardings=sharding.state_shardings(mesh, shapes))(params)


def restore(cfg: TrainConfig, checkpoints: checkpoint.RunCheckpoints, params, opt_state,
            identity: dict) -> State:
  """The state after the latest usable checkpoint on --resume, else the initial state.

  A checkpoint of other settings is refused, naming them, and nothing is moved. A resume
  that finds no checkpoint at all starts at step 1 only where no metrics of an earlier
  run would be lost.
  """
  initial = State(params, opt_state, bandit.BanditState.initial(len(corpus.SOURCE_NAMES)), 0)
  if not cfg.resume:
    return initial

  def check_settings(host: dict) -> None:
    changed = [f"{k}={host['identity'].get(k)!r} (now {v!r})" for k, v in identity.items()
               if host["identity"].get(k) != v]
    if changed:
      raise ConfigError(f"--resume: the checkpoint in {checkpoints.directory} was made "
                        f"with other settings: {'; '.join(changed)}")

  restored = checkpoints.restore_latest_good(params, opt_state, status.say, check_settings)
  if restored is None:
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if records := metrics.read_records(path, damaged=[]):
      raise ConfigError(
          f"--resume: {cfg.out_dir} has no checkpoint to continue from, and {path} holds "
          f"{len(records)} records of an earlier run; pass --overwrite (without --resume) "
          "to replace that run")
    return initial
  step, host, params, opt_state = restored
  return State(params, opt_state, bandit.BanditState.from_json(host["bandit"]), step)


def open_metrics_log(cfg: TrainConfig, step_done: int) -> metrics.MetricsLog:
  """metrics.jsonl cut back to the restored step; one warning if step records are lost."""
  path = os.path.join(cfg.out_dir, "metrics.jsonl")
  log = metrics.MetricsLog(path, resume_after_step=step_done, warn=status.say)
  if missing := metrics.missing_steps(log.records, step_done):
    status.say(f"warning: {path} lacks the records of {len(missing)} of the {step_done} "
               f"steps before this resume (first: step {missing[0]}); the report covers "
               "the rest")
  return log


def describe_start(cfg: TrainConfig, mesh, state: State) -> str:
  params = model_lib.count_params(state.params) / 1e6
  clip = "off" if cfg.max_norm <= 0 else f"{cfg.max_norm:g}"
  line = (f"{cfg.config}: {params:.1f}M parameters on {mesh.size} "
          f"{jax.devices()[0].platform} device(s) (mesh {sharding.describe(mesh)}); clip "
          f"{clip} (impl {cfg.clip_impl}, mode {cfg.clip_mode}); out {cfg.out_dir}")
  if state.step_done:
    return line + f"; resumed after step {state.step_done}"
  return line + ("; --resume found no checkpoint, starting at step 1" if cfg.resume else "")


# --- The steps --------------------------------------------------------------------


def run_steps(loop: Loop, state: State) -> int | None:
  """Steps step_done + 1 .. last_step; returns the step after which --time-limit-s
  stopped the run, or None."""
  cfg, first = loop.cfg, state.step_done + 1
  state.last_time = time.perf_counter()
  for step in range(first, loop.last_step + 1):
    phase = bisect.bisect_right(loop.phase_starts, step) - 1
    phase_end = (loop.phase_starts + [cfg.steps + 1])[phase + 1] - 1
    if step == loop.phase_starts[phase]:
      fetch_pending(loop, state)
      start_phase(loop, state, step, phase, phase_end)
    if step == loop.phase_starts[phase] or step == first:
      loop.prefetcher.start_phase(step, min(phase_end, loop.last_step), state.bandit.weights)
    tokens_BxL1, source_B = loop.prefetcher.next(step)
    compiling = status.timed("compiling the training step", loop.say) if step == first \
        else contextlib.nullcontext()
    with compiling:
      state.params, state.opt_state, step_metrics = loop.train_step(
          state.params, state.opt_state, tokens_BxL1, source_B, jnp.int32(step))
    fetch_pending(loop, state)  # the previous step's metrics, while this step runs
    state.pending, state.step_done = (step, phase, step_metrics), step
    out_of_time = (cfg.time_limit_s is not None
                   and time.perf_counter() - loop.started > cfg.time_limit_s)
    if step % cfg.checkpoint_every == 0 or step == loop.last_step or out_of_time:
      fetch_pending(loop, state)
      save_checkpoint(loop, state)
    if out_of_time and step < loop.last_step:
      loop.say(f"--time-limit-s {cfg.time_limit_s:g} reached: stopping after step {step} "
               f"of {cfg.steps}")
      return step
  return None


def start_phase(loop: Loop, state: State, step: int, phase: int, phase_end: int) -> None:
  """A phase boundary: new weights from the ending phase's rewards, logged and printed."""
  reward = None
  if phase > 0:
    state.bandit, reward = bandit.end_phase(state.bandit, loop.cfg.bandit_config)
  record = metrics.phase_record(step, phase, phase_end - step + 1, corpus.SOURCE_NAMES,
                                state.bandit.weights, reward)
  loop.log.write(record)
  weights = " ".join(f"{n} {w:.2f}" for n, w in record["weights"].items())
  rewards = "" if reward is None else " | reward " + " ".join(f"{r:.2f}" for r in reward)
  loop.say(f"phase {phase} at step {step} ({record['length']} steps): weights "
           f"{weights}{rewards}")


def fetch_pending(loop: Loop, state: State) -> None:
  """Logs the pending step's metrics (the device has usually finished it by now), feeds
  the bandit, and stops the run after --nonfinite-stop NaN/inf steps in a row."""
  if state.pending is None:
    return
  (step, phase, step_metrics), state.pending = state.pending, None
  m = jax.device_get(step_metrics)
  now = time.perf_counter()
  seconds, state.last_time = now - state.last_time, now
  tokens_per_step = loop.cfg.batch_size * loop.cfg.context_length
  memory = sharding.memory_in_use((state.params, state.opt_state))
  loop.log.write(metrics.step_record(step, phase, corpus.SOURCE_NAMES, m,
                                     tokens_per_step / max(seconds, 1e-9), seconds, memory,
                                     loop.leaf_names))
  loop.bar.update(1)
  loop.bar.set_postfix(loss=f"{m['loss']:.3f}", gnorm=f"{m['grad_norm']:.2f}", phase=phase)
  if np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]):
    state.bandit = bandit.observe(state.bandit, m["loss_sum_K"], m["rows_K"])
    state.nonfinite_steps = []
    return
  state.nonfinite_steps.append(step)  # a NaN loss must not reach the bandit's weights
  if len(state.nonfinite_steps) >= loop.cfg.nonfinite_stop:
    first = state.nonfinite_steps[0]
    good = [s for s in loop.checkpoints.steps() if s < first]
    raise TrainingDiverged(
        f"the loss or gradient norm was NaN/inf for {len(state.nonfinite_steps)} steps in "
        f"a row (steps {first}-{step}); stopping. The latest checkpoint before them: "
        + (f"step {good[-1]} in {loop.checkpoints.directory}" if good else "none"))


def save_checkpoint(loop: Loop, state: State) -> None:
  """Saves the state after step_done, unless it holds NaN or inf; prints where."""
  step = state.step_done
  if state.nonfinite_steps or not checkpoint.all_finite((state.params, state.opt_state)):
    loop.say(f"step {step}: not saving a checkpoint that holds NaN or inf")
    return
  path = loop.checkpoints.save(step, state.params, state.opt_state, {
      "step": step, "bandit": state.bandit.to_json(), "identity": loop.identity})
  loop.run_dir.keep_new()  # a run replaced by --overwrite is deleted only now
  loop.say(f"step {step}: checkpoint {path} "
           f"({checkpoint.directory_bytes(path) / 2**20:.1f} MB)")
