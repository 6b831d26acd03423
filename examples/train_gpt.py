"""Trains the GPT on the bandit-mixed sources with andrea_clip ahead of AdamW.

    python examples/train_gpt.py --config tiny                # CPU, a few minutes
    python examples/train_gpt.py --config andrea-12m --source gutenberg=books/*.txt
    python examples/train_gpt.py --config andrea-120m --recipe v1   # no clip, Adam

The optimizer (recipe v2) is

    optax.chain(clipjax.andrea_clip(max_norm), optax.adamw(schedule, weight_decay))

with a linear warmup to the peak learning rate (step 1 gets peak / warmup_steps) and a
cosine decay after it. Recipe v1 is the ANDREA v1 recipe: no clipping, Adam without
weight decay, no warmup. Every step writes a JSONL record to OUT_DIR/metrics.jsonl; the
pre-clip global norm and the clipped flag are read from the andrea_clip state, never
computed again (v1 has no clip, so there clipjax.global_norm computes the norm).

`train(TrainConfig(...))` runs the same loop from Python and returns the records.
"""

import bisect
import dataclasses
import functools
import os
import sys
import time

import clipjax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import bandit
import checkpoint
import corpus
import metrics
from config import ConfigError, TrainConfig, parse_args, resolve, RUN_IDENTITY
import model as model_lib
import pipeline
import report
import tokenizer as tokenizer_lib


def lr_schedule(cfg: TrainConfig):
  """Learning rate of update `count` (0-based; that update is training step count + 1)."""
  peak, warmup, end = cfg.peak_lr, cfg.warmup_steps, cfg.peak_lr * cfg.end_lr_ratio

  def schedule(count):
    step = count + 1
    warming = peak * step / max(warmup, 1)
    progress = jnp.clip((step - warmup) / max(cfg.steps - warmup, 1), 0.0, 1.0)
    decaying = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(step <= warmup, warming, decaying)

  return schedule


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  # weight_decay 0 makes adamw plain Adam: the v1 recipe.
  adam = optax.adamw(lr_schedule(cfg), weight_decay=cfg.weight_decay)
  if cfg.max_norm <= 0:
    return adam
  clip = clipjax.andrea_clip(cfg.max_norm, impl=cfg.clip_impl, mode=cfg.clip_mode)
  return optax.chain(clip, adam)


def make_train_step(graphdef, tx, cfg: TrainConfig, num_sources: int):
  schedule = lr_schedule(cfg)

  def loss_fn(params, tokens_BxL1):
    logits_BxLxV = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1])
    loss_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV, tokens_BxL1[:, 1:])
    loss_B = loss_BxL.mean(axis=1)
    return loss_B.mean(), loss_B

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, tokens_BxL1, source_B, step):
    (loss, loss_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BxL1)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if cfg.max_norm > 0:
      clip_state = clipjax.clip_state(opt_state)
      grad_norm, clipped = clip_state.global_norm, clip_state.clipped
    else:
      grad_norm, clipped = clipjax.global_norm(grads, impl=cfg.clip_impl), False
    metrics = {
        "loss": loss, "grad_norm": grad_norm, "clipped": clipped, "lr": schedule(step - 1),
        "loss_sum_K": jax.ops.segment_sum(loss_B, source_B, num_sources),
        "rows_K": jax.ops.segment_sum(jnp.ones_like(loss_B), source_B, num_sources),
    }
    return params, opt_state, metrics

  return train_step


class TrainingDiverged(Exception):
  """The loss or the gradient norm stayed NaN/inf for --nonfinite-stop steps in a row."""


def train(cfg: TrainConfig) -> list[dict]:
  """Runs (or resumes) training; returns every metrics record of the run so far."""
  cfg = resolve(cfg)
  started = time.perf_counter()
  names = corpus.SOURCE_NAMES
  texts = corpus.load_corpus(corpus.parse_source_flags(cfg.sources),
                             int(cfg.max_source_mb * 2**20))
  tokenizer, streams, corpus_key = tokenizer_lib.load_tokenizer_and_streams(
      texts, cfg.vocab_size, cfg.cache_dir)
  for name in names:
    if len(streams[name]) <= cfg.context_length:
      raise corpus.SourceError(
          f"source {name!r} has {len(streams[name])} tokens; a batch row needs "
          f"--context-length + 1 = {cfg.context_length + 1}")

  model_cfg = dataclasses.replace(
      model_lib.MODEL_CONFIGS[cfg.config], vocab_size=cfg.vocab_size,
      context_length=cfg.context_length, dtype=cfg.dtype)
  graphdef, state = nnx.split(model_lib.GPT(model_cfg, nnx.Rngs(cfg.seed)))
  params = nnx.to_pure_dict(state)
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  train_step = make_train_step(graphdef, tx, cfg, len(names))

  identity = {k: v for k, v in dataclasses.asdict(cfg).items() if k in RUN_IDENTITY}
  identity["corpus"] = corpus_key
  os.makedirs(cfg.out_dir, exist_ok=True)
  ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
  metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
  bandit_state, step_done = bandit.BanditState.initial(len(names)), 0
  checkpoints = checkpoint.RunCheckpoints(ckpt_dir, fresh=not cfg.resume)
  if cfg.resume:
    restored = checkpoints.restore_latest_good(params, opt_state, print)
    if restored is not None:
      step_done, host, params, opt_state = restored
      _check_same_run(host["identity"], identity, ckpt_dir)
      bandit_state = bandit.BanditState.from_json(host["bandit"])
  log = metrics.MetricsLog(metrics_path, resume_after_step=step_done)
  records = log.records
  if missing := metrics.missing_steps(records, step_done):
    print(f"warning: {metrics_path} lacks the records of {len(missing)} of the {step_done} "
          f"steps before this resume (first: step {missing[0]}); the report covers the rest")
  metrics.write_json_atomic(os.path.join(cfg.out_dir, "config.json"),
                            dataclasses.asdict(cfg))

  last_step = cfg.stop_after_step or cfg.steps
  phase_starts = bandit.phase_starts(cfg.seed, cfg.steps)
  prefetcher = pipeline.Prefetcher(
      [streams[n] for n in names], seed=cfg.seed, batch_size=cfg.batch_size,
      context_length=cfg.context_length)
  tokens_per_step = cfg.batch_size * cfg.context_length
  bar = tqdm(total=last_step, initial=step_done, disable=not cfg.progress,
             desc=f"{cfg.config} {cfg.recipe}", dynamic_ncols=True)
  _log(bar, f"{cfg.config}: {model_lib.count_params(params) / 1e6:.1f}M parameters on "
       f"{jax.devices()[0].platform}; clip {'off' if cfg.max_norm <= 0 else cfg.max_norm} "
       f"(impl {cfg.clip_impl}, mode {cfg.clip_mode}); out {cfg.out_dir}"
       + (f"; resumed after step {step_done}" if step_done else "")
       + ("; --resume found no checkpoint, starting at step 1" if cfg.resume and not step_done
          else ""))

  pending, last_time, nonfinite_run = None, time.perf_counter(), []
  write = log.write

  def flush():
    """Fetches the pending step's metrics (the device has usually finished it by now)."""
    nonlocal pending, last_time, bandit_state
    if pending is None:
      return
    (step, phase, step_metrics), pending = pending, None
    m = jax.device_get(step_metrics)
    now = time.perf_counter()
    seconds, last_time = now - last_time, now
    finite = bool(np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]))
    if finite:  # a NaN loss must not reach the bandit's weights
      bandit_state = bandit.observe(bandit_state, m["loss_sum_K"], m["rows_K"])
    write({
        "kind": "step", "step": step, "phase": phase, "loss": float(m["loss"]),
        "loss_by_source": {n: (float(m["loss_sum_K"][k] / m["rows_K"][k])
                               if m["rows_K"][k] else None) for k, n in enumerate(names)},
        "grad_norm": float(m["grad_norm"]), "clipped": bool(m["clipped"]),
        "lr": float(m["lr"]), "tokens_per_s": tokens_per_step / max(seconds, 1e-9),
    })
    bar.update(1)
    bar.set_postfix(loss=f"{m['loss']:.3f}", gnorm=f"{m['grad_norm']:.2f}", phase=phase)
    nonfinite_run[:] = [] if finite else nonfinite_run + [step]
    if len(nonfinite_run) >= cfg.nonfinite_stop:
      good = [s for s in checkpoints.steps() if s < nonfinite_run[0]]
      raise TrainingDiverged(
          f"the loss or gradient norm was NaN/inf for {len(nonfinite_run)} steps in a row "
          f"(steps {nonfinite_run[0]}-{step}); stopping. The latest checkpoint before them: "
          + (f"step {good[-1]} in {ckpt_dir}" if good else "none"))

  stopped_at = None
  try:
    for step in range(step_done + 1, last_step + 1):
      phase = bisect.bisect_right(phase_starts, step) - 1
      phase_end = (phase_starts + [cfg.steps + 1])[phase + 1] - 1
      if step == phase_starts[phase]:
        flush()
        reward = None
        if phase > 0:
          bandit_state, reward = bandit.end_phase(bandit_state, cfg.bandit_config)
        write({"kind": "phase", "step": step, "phase": phase,
               "length": phase_end - step + 1,
               "weights": dict(zip(names, bandit_state.weights.tolist())),
               "reward": None if reward is None else dict(zip(names, reward.tolist()))})
        _log(bar, _describe_phase(records[-1]))
      if step == phase_starts[phase] or step == step_done + 1:
        prefetcher.start_phase(step, min(phase_end, last_step), bandit_state.weights)
      tokens_BxL1, source_B = prefetcher.next(step)
      params, opt_state, step_metrics = train_step(
          params, opt_state, tokens_BxL1, source_B, jnp.int32(step))
      flush()  # the previous step's metrics, while this step runs
      pending = (step, phase, step_metrics)
      out_of_time = (cfg.time_limit_s is not None
                     and time.perf_counter() - started > cfg.time_limit_s)
      if step % cfg.checkpoint_every == 0 or step == last_step or out_of_time:
        flush()
        if nonfinite_run or not checkpoint.all_finite((params, opt_state)):
          _log(bar, f"step {step}: not saving a checkpoint that holds NaN or inf")
        else:
          checkpoints.save(step, params, opt_state, {
              "step": step, "bandit": bandit_state.to_json(), "identity": identity})
      if out_of_time and step < last_step:
        stopped_at = step
        _log(bar, f"--time-limit-s {cfg.time_limit_s:g} reached: stopping after step {step} "
             f"of {cfg.steps}")
        break
  finally:
    prefetcher.close()
    checkpoints.close()
    log.close()
    bar.close()

  if last_step == cfg.steps:
    _finish(cfg, records, graphdef, params, tokenizer, started, stopped_at)
  return records


def _finish(cfg, records, graphdef, params, tokenizer, started, stopped_at=None) -> None:
  """Writes report.png, samples.txt and summary.json into the run directory."""
  steps = [r for r in records if r["kind"] == "step"]
  summary = {
      "config": cfg.config, "recipe": cfg.recipe, "steps": len(steps),
      "planned_steps": cfg.steps, "stopped_by_time_limit": stopped_at is not None,
      "initial_loss": steps[0]["loss"],
      "final_loss": float(np.mean([r["loss"] for r in steps[-10:]])),
      "clipped_steps": sum(r["clipped"] for r in steps),
      "median_tokens_per_s": float(np.median([r["tokens_per_s"] for r in steps])),
      # Step records lost with an earlier run's metrics (see MetricsLog); 0 when whole.
      "missing_step_records": len(metrics.missing_steps(records, steps[-1]["step"])),
  }
  if cfg.plot:
    png = os.path.join(cfg.out_dir, "report.png")
    report.plot_run(records, f"{png}.tmp.png", max_norm=cfg.max_norm,
                    title=f"{cfg.config}, recipe {cfg.recipe}, seed {cfg.seed}")
    os.replace(f"{png}.tmp.png", png)
  if cfg.num_samples > 0:
    prompts = [report.SAMPLE_PROMPTS[i % len(report.SAMPLE_PROMPTS)]
               for i in range(cfg.num_samples)]
    outputs = report.generate(
        graphdef, params, [tokenizer.encode(p).ids for p in prompts],
        num_tokens=cfg.sample_tokens, context_length=cfg.context_length,
        temperature=cfg.sample_temperature, seed=cfg.seed)
    stats = [report.repetition_stats(ids) for ids in outputs]
    summary["repetition"] = report.mean_stats(stats)
    summary["samples"] = [
        {"prompt": p, "text": tokenizer.decode(ids, skip_special_tokens=False), **s}
        for p, ids, s in zip(prompts, outputs, stats)]
    metrics.write_atomic(os.path.join(cfg.out_dir, "samples.txt"), lambda f: f.writelines(
        f"--- distinct_2 {sample['distinct_2']:.2f}  repeat_4 "
        f"{sample['repeat_4']:.2f}  top_token_share {sample['top_token_share']:.2f}\n"
        f"{sample['prompt']}{sample['text']}\n\n" for sample in summary["samples"]))
  summary["wall_s"] = time.perf_counter() - started
  metrics.write_json_atomic(os.path.join(cfg.out_dir, "summary.json"), summary)
  repetition = ", ".join(f"{k} {v:.2f}" for k, v in summary.get("repetition", {}).items())
  print(f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the "
        f"last 10 steps); {summary['clipped_steps']} of {len(steps)} steps clipped; "
        f"samples: {repetition or 'none'}; files in {cfg.out_dir}")


def _check_same_run(saved: dict, now: dict, ckpt_dir: str) -> None:
  changed = [f"{k}={saved.get(k)!r} (now {now[k]!r})" for k in now if saved.get(k) != now[k]]
  if changed:
    raise ConfigError(f"--resume: the checkpoint in {ckpt_dir} was made with other "
                      f"settings: {'; '.join(changed)}")


def _describe_phase(record: dict) -> str:
  weights = " ".join(f"{n} {w:.2f}" for n, w in record["weights"].items())
  reward = ("" if record["reward"] is None else " | reward " + " ".join(
      f"{r:.2f}" for r in record["reward"].values()))
  return (f"phase {record['phase']} at step {record['step']} ({record['length']} steps): "
          f"weights {weights}{reward}")


def _log(bar, message: str) -> None:
  if bar.disable:
    print(message)
  else:
    bar.write(message)


def main(argv: list[str] | None = None) -> None:
  parser, cfg = parse_args(argv)
  try:
    train(cfg)
  except (ConfigError, corpus.SourceError, checkpoint.CheckpointError) as e:
    parser.error(str(e))
  except TrainingDiverged as e:
    sys.exit(f"train_gpt.py: {e}")


if __name__ == "__main__":
  main()
