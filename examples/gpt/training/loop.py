"""The training loop: the data, the model and the run directory, then the steps in order.

`train(cfg)` runs (or resumes) a run and returns every metrics record of it so far:

  distributed.launch  joins the run's other processes, if it has any
  lock_run_dir   the run directory's lock (run_dir.py): a live run there refuses this one
  make_mesh      the device mesh (--mesh) and the batch sharding
  load_data      the sources (held-out text split off), the tokenizer, the token streams
  init_model     the GPT's graph and initial parameters, made on the mesh
  open_run_dir   only then, the run directory (run_dir.py): an earlier run is refused
                 unless --resume, and set aside, not deleted, by --overwrite
  restore        on --resume, the latest usable checkpoint of the same settings
  steps.run_steps  phases and the bandit, the jitted step, the metrics log, checkpoints
  report         summary.json, report.png and samples.txt, once the last step is done

`start` and `finish` are the parts before and after the steps, for callers that run the
steps themselves (experiments/bench_speed.py); such a caller then releases the run
directory with `run.loop.run_dir.close()`.
"""

import dataclasses
import os
import time
from typing import Any, Callable

import clipjax
import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from .. import model as model_lib
from ..config import CONFIG_FILE, RUN_IDENTITY, ConfigError, TrainConfig, resolve
from ..data import bandit, corpus, pipeline, tokenizer as tokenizer_lib
from ..reports import metrics, report, throughput
from . import checkpoint, distributed, run_dir as run_dir_lib, sharding, status, steps
from . import train_step as train_step_lib
from .steps import State, Stopped, TrainingDiverged  # noqa: F401 - the loop's API

# Errors in what the user gave: a flag, a source, the run directory. One line, no traceback.
USER_ERRORS = (ConfigError, corpus.SourceError, checkpoint.CheckpointError,
               sharding.MeshError)


@dataclasses.dataclass(frozen=True)
class Data:
  streams: list[np.ndarray]  # one int32 token stream per source, in SOURCE_NAMES order
  tokenizer: Any
  corpus_key: str  # a hash of the training text and the vocabulary size
  prompts: list[str]  # the sample prompts: --prompt, else cut from the held-out text


@dataclasses.dataclass(frozen=True)
class Run:
  """A started run: its steps' loop and state, and what the report needs."""
  loop: steps.Loop
  state: State
  data: Data
  graphdef: Any


def train(cfg: TrainConfig) -> list[dict]:
  """Runs (or resumes) training; returns every metrics record of the run so far."""
  run = start(cfg)
  try:
    try:
      stopped_at = steps.run_steps(run.loop, run.state)
    finally:
      finish(run)
    cfg = run.loop.cfg
    if run.loop.last_step == cfg.steps:
      report.write_report(cfg, run.loop.log.records, run.graphdef, run.state.params,
                          run.data.tokenizer, run.data.prompts, run.loop.started, stopped_at,
                          run.loop.flops_per_token, run.loop.peak_flops)
    else:
      status.say(steps.saved_and_stopped(f"--stop-after-step {cfg.stop_after_step}",
                                         run.loop.last_step, run.loop))
  except BaseException:
    run.loop.run_dir.close(failed=True)  # no checkpoint yet: the run it replaced stays
    raise
  run.loop.run_dir.close()
  distributed.barrier("the run is complete")
  return run.loop.log.records


def start(cfg: TrainConfig) -> Run:
  """Everything before the first step: processes, data, model, optimizer, the jitted
  step, then the run directory, and the restored state on --resume. An error after the
  directory is open puts back a run that --overwrite had set aside."""
  started = time.perf_counter()
  distributed.launch(cfg.coordinator, cfg.num_processes, cfg.process_id,
                     cfg.heartbeat_timeout_s)
  cfg = resolve(cfg)
  run_dir = run_dir_lib.RunDir(cfg.out_dir, None, lock=on_main(
      cfg, lambda: run_dir_lib.lock_run_dir(cfg.out_dir)))
  try:
    mesh = make_mesh(cfg)
    data = load_data(cfg)
    graphdef, params = init_model(cfg, mesh)
    tx = train_step_lib.make_optimizer(cfg)
    opt_state = init_opt_state(tx, params, mesh)
    train_step = train_step_lib.train_step_for(graphdef, cfg, len(corpus.SOURCE_NAMES),
                                               mesh, params, opt_state)
    run_dir = open_run_dir(cfg, run_dir.lock) or run_dir  # None on the other processes
    return _start_in_dir(cfg, run_dir, started, mesh, data, graphdef, params, opt_state,
                         train_step)
  except BaseException:
    run_dir.close(failed=True)
    raise


def _start_in_dir(cfg, run_dir, started, mesh, data, graphdef, params, opt_state, train_step):
  """`start`'s part once the run directory is open: checkpoints, the restored state, the
  metrics log and the loop."""
  checkpoints = checkpoint.RunCheckpoints(os.path.join(cfg.out_dir, "checkpoints"),
                                          fresh=not cfg.resume, keep=cfg.keep_checkpoints)
  identity = {k: v for k, v in dataclasses.asdict(cfg).items() if k in RUN_IDENTITY}
  identity["corpus"] = data.corpus_key
  state = restore(cfg, checkpoints, params, opt_state, identity)
  log = open_metrics_log(cfg, state.step_done)
  if distributed.is_main():
    metrics.write_json_atomic(os.path.join(cfg.out_dir, CONFIG_FILE),
                              dataclasses.asdict(cfg))
  last_step = cfg.stop_after_step or cfg.steps
  bar = tqdm(total=last_step, initial=state.step_done,
             disable=not (cfg.progress and distributed.is_main()),
             desc=f"{cfg.config} {cfg.recipe}", dynamic_ncols=True)
  model_cfg = model_config(cfg)
  loop = steps.Loop(
      cfg=cfg, train_step=train_step,
      prefetcher=pipeline.Prefetcher(data.streams, seed=cfg.seed, batch_size=cfg.batch_size,
                                     context_length=cfg.context_length,
                                     sharding=sharding.batch_sharding(mesh)),
      checkpoints=checkpoints, run_dir=run_dir, log=log,
      say=bar.write if cfg.progress and distributed.is_main() else status.say,
      bar=bar, identity=identity, phase_starts=bandit.phase_starts(cfg.seed, cfg.steps),
      last_step=last_step, started=started,
      leaf_names=list(clipjax.named_leaf_norms(opt_state, params)) if cfg.max_norm > 0 else [],
      flops_per_token=throughput.flops_per_token(
          params, num_layers=model_cfg.num_layers, d_model=model_cfg.d_model,
          context_length=cfg.context_length),
      peak_flops=throughput.peak_flops(mesh.devices.flat, cfg.peak_tflops))
  loop.say(describe_start(cfg, mesh, state, loop.peak_flops))
  return Run(loop, state, data, graphdef)


def finish(run: Run) -> None:
  """Stops the batch thread and closes the checkpoints, the log and the progress bar; the
  run directory stays locked until `run.loop.run_dir.close()`."""
  run.loop.prefetcher.close()
  run.loop.checkpoints.close()
  run.loop.log.close()
  run.loop.bar.close()


# --- Before the first step --------------------------------------------------------


def open_run_dir(cfg: TrainConfig, lock: run_dir_lib.RunLock | None) -> run_dir_lib.RunDir:
  """The run directory (run_dir.py), opened by process 0 (which holds its `lock`) while
  the others wait; where it is refused (an earlier run, without --resume or --overwrite)
  every process raises. None on the other processes."""
  return on_main(cfg, lambda: run_dir_lib.open_run_dir(
      cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite, say=status.say, lock=lock))


def on_main(cfg: TrainConfig, act: Callable[[], Any]) -> Any:
  """`act()`'s result on process 0, which alone writes the run directory, and None on the
  others, which wait for it; a ConfigError of process 0's is raised on every process."""
  result, error = None, None
  if distributed.is_main():
    try:
      result = act()
    except ConfigError as e:
      error = e
  if not distributed.agree(error is None):  # also: the others wait for process 0 here
    raise error or ConfigError(f"--out-dir {cfg.out_dir}: process 0 refused it (its own "
                               "message says why)")
  return result


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


def model_config(cfg: TrainConfig) -> model_lib.ModelConfig:
  return dataclasses.replace(
      model_lib.MODEL_CONFIGS[cfg.config], vocab_size=cfg.vocab_size,
      context_length=cfg.context_length, dtype=cfg.dtype, attention=cfg.attention,
      remat=cfg.remat)


def init_model(cfg: TrainConfig, mesh=None):
  """(graphdef, params): the model's structure and its initial parameters (a pure dict),
  placed on the mesh's fsdp shardings when one is given. The values do not depend on
  the mesh. Every process makes them all and puts its own devices' shards in place:
  no process sends another anything."""
  graphdef, state = nnx.split(model_lib.GPT(model_config(cfg), nnx.Rngs(cfg.seed)))
  params = nnx.to_pure_dict(state)
  if mesh is None:
    return graphdef, params
  host = jax.device_get(params)
  return graphdef, jax.tree.map(
      lambda x, place: jax.make_array_from_callback(x.shape, place, lambda i: x[i]),
      host, sharding.state_shardings(mesh, host))


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
  log = metrics.MetricsLog(path, resume_after_step=step_done, write=distributed.is_main(),
                           warn=status.say)
  if missing := metrics.missing_steps(log.records, step_done):
    status.say(f"warning: {path} lacks the records of {len(missing)} of the {step_done} "
               f"steps before this resume (first: step {missing[0]}); the report covers "
               "the rest")
  return log


def describe_start(cfg: TrainConfig, mesh, state: State, peak_flops: float | None) -> str:
  params = model_lib.count_params(state.params) / 1e6
  clip = "off" if cfg.max_norm <= 0 else f"{cfg.max_norm:g}"
  processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  peak = (f"peak {peak_flops / 1e12:,.0f} TFLOP/s" if peak_flops
          else "peak unknown: no MFU (--peak-tflops)")
  line = (f"{cfg.config}: {params:.1f}M parameters on {mesh.size} "
          f"{jax.devices()[0].device_kind} device(s){processes} (mesh "
          f"{sharding.describe(mesh)}); {cfg.dtype}, attention {cfg.attention}, remat "
          f"{cfg.remat}; {peak}; clip {clip} (impl {cfg.clip_impl}, mode {cfg.clip_mode}); "
          f"out {cfg.out_dir}")
  if state.step_done:
    return line + f"; resumed after step {state.step_done}"
  return line + ("; --resume found no checkpoint, starting at step 1" if cfg.resume else "")
