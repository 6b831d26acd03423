"""Every setting of a training run, its defaults per config and recipe, and the flags.

A TrainConfig field left None is filled by `check`: from the recipe first (RECIPES),
then from the config's preset (PRESETS); an explicit value always wins. The andrea
presets follow the ANDREA documents (peak lr 3e-4, a 2000-step warmup, so step 1 has lr
1.5e-7); `tiny` uses a higher peak and a short warmup so it learns within minutes on a
CPU. "auto" settings (dtype, attention) are resolved for the platform the run is on.
"""

import argparse
import dataclasses
import json
import math
import os

import numpy as np

from .data import bandit, corpus, tokenizer as tokenizer_lib

ANDREA_VOCAB_SIZE = 8449
REMAT_CHOICES = ("none", "block", "dots")  # model.py's REMAT_POLICIES, and "none"
# Learned positions up to this many tokens (8x andrea-120m's context); a longer context is
# a typo more often than a plan, and would compile for minutes before it failed.
MAX_CONTEXT_LENGTH = 8192


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  config: str = "tiny"
  recipe: str = "v2"
  # None: from the recipe (RECIPES), else from the config's preset (PRESETS).
  steps: int | None = None
  batch_size: int | None = None
  context_length: int | None = None
  peak_lr: float | None = None
  warmup_steps: int | None = None
  weight_decay: float | None = None
  max_norm: float | None = None  # 0: no clipping
  checkpoint_every: int | None = None
  end_lr_ratio: float = 0.1  # the cosine decay ends at peak_lr * end_lr_ratio
  clip_impl: str = "auto"
  clip_mode: str = "global"
  # "off"; "zscore": andrea_clip(spike=ZScoreSpike()) clips spikes to their threshold;
  # "skip": that, inside clipjax.skip_spikes, which skips spike and NaN/inf steps.
  spike: str = "off"
  # Computation dtype ("auto": bfloat16 on GPUs and TPUs, float32 on CPUs); parameters
  # and optimizer state are float32 either way.
  dtype: str = "auto"
  attention: str = "auto"  # "auto": cudnn on a GPU in bfloat16, else xla (model.py)
  remat: str = "none"  # recompute activations in the backward pass: none, block, dots
  log_every: int = 10  # steps whose metrics are fetched from the devices in one go
  peak_tflops: float | None = None  # the devices' dense peak for MFU; None: throughput.py
  # "data=N,fsdp=M" (sharding.py); None: every visible device on the data axis. Not part
  # of the run's identity: a run resumes on another mesh with the same losses.
  mesh: str | None = None
  # A run of several processes (distributed.py): JAX's cluster detection, else these.
  coordinator: str | None = None  # HOST:PORT of process 0's coordination service
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = 100  # a process silent this long stops the others
  vocab_size: int = ANDREA_VOCAB_SIZE
  seed: int = 0
  sources: tuple[str, ...] = ()  # "NAME=PATH_OR_GLOB"; unnamed sources use the default
  max_source_mb: float = 16.0
  bandit_config: bandit.BanditConfig = bandit.BanditConfig()
  out_dir: str | None = None  # default: runs/CONFIG-RECIPE
  cache_dir: str | None = None  # default: ~/.cache/clipjax
  resume: bool = False
  overwrite: bool = False  # replace an earlier run in out_dir (without it, that is refused)
  keep_checkpoints: int = 2  # the latest this many checkpoints are kept
  stop_after_step: int | None = None  # end this run early, as if interrupted
  # Wall-clock budget: the run ends (and reports) after the step during which it runs out.
  # The schedule still spans `steps`, so such a run is the head of the planned one.
  time_limit_s: float | None = None
  nonfinite_stop: int = 3  # stop after this many steps in a row with a NaN/inf loss or norm
  num_samples: int = 3  # prompts drawn from the held-out text, unless `prompts` are given
  prompts: tuple[str, ...] = ()
  sample_tokens: int = 96
  sample_temperature: float = 0.8
  plot: bool = True
  progress: bool = True


PRESETS = {
    "tiny": dict(steps=300, batch_size=16, context_length=128, peak_lr=3e-3,
                 warmup_steps=30, checkpoint_every=100),
    "andrea-12m": dict(steps=10_000, batch_size=64, context_length=512, peak_lr=3e-4,
                       warmup_steps=2000, checkpoint_every=1000),
    "andrea-120m": dict(steps=10_000, batch_size=16, context_length=1024, peak_lr=3e-4,
                        warmup_steps=2000, checkpoint_every=1000),
}
RECIPES = {
    "v2": dict(max_norm=1.0, weight_decay=0.1),
    "v1": dict(max_norm=0.0, weight_decay=0.0, warmup_steps=0),
}
CHOICES = {"config": tuple(PRESETS), "recipe": tuple(RECIPES),
           "clip_impl": ("auto", "jax", "ffi"), "clip_mode": ("global", "per_tensor"),
           "spike": ("off", "zscore", "skip"), "dtype": ("auto", "float32", "bfloat16"),
           "attention": ("auto", "xla", "cudnn"), "remat": REMAT_CHOICES}
# Settings a resumed run must share with the checkpoint for its losses to be the same.
RUN_IDENTITY = ("config", "recipe", "steps", "batch_size", "context_length", "peak_lr",
                "warmup_steps", "weight_decay", "max_norm", "end_lr_ratio", "clip_mode",
                "spike", "dtype", "vocab_size", "seed", "bandit_config")


# Settings of one start of a run, not of the run: a --resume takes none of them from the
# run's config.json (a run stopped by --stop-after-step goes on to the end).
PER_START = ("out_dir", "resume", "overwrite", "stop_after_step", "time_limit_s",
             "coordinator", "num_processes", "process_id")
CONFIG_FILE = "config.json"  # every setting of a run, in its directory


class ConfigError(ValueError):
  """A setting that cannot be used; the message names the flag."""


def check(cfg: TrainConfig) -> TrainConfig:
  """Fills the None fields from the recipe and the preset, and checks every setting: the
  flags, the --source patterns and the directories, before anything is read or written,
  and without jax (the "auto" settings stay: `resolve` fills them for the platform)."""
  for field, choices in CHOICES.items():
    if getattr(cfg, field) not in choices:
      raise ConfigError(f"--{field.replace('_', '-')} {getattr(cfg, field)!r}: "
                        f"choose one of {', '.join(choices)}")
  filled = {**PRESETS[cfg.config], **RECIPES[cfg.recipe]}
  filled = {k: v for k, v in filled.items() if getattr(cfg, k) is None}
  filled["out_dir"] = out_dir_of(cfg)
  filled["cache_dir"] = cfg.cache_dir or tokenizer_lib.default_cache_dir()
  cfg = dataclasses.replace(cfg, **filled)
  _check_numbers(cfg)
  for field in ("out_dir", "cache_dir"):
    _check_directory(f"--{field.replace('_', '-')}", getattr(cfg, field))
  corpus.check_source_flags(cfg.sources)
  return cfg


def out_dir_of(cfg: TrainConfig) -> str:
  """--out-dir, by default runs/CONFIG-RECIPE."""
  return cfg.out_dir or os.path.join("runs", f"{cfg.config}-{cfg.recipe}")


def resumed(cfg: TrainConfig, given: tuple[str, ...]) -> TrainConfig:
  """A --resume's settings: the run's own, from the config.json in its directory, where
  the command line does not give them (`given`: the TrainConfig fields it gives, and
  bandit_eta, bandit_floor, bandit_smoothing). PER_START settings are this start's. A
  given setting that changes the run's losses is refused once the checkpoint is read
  (RUN_IDENTITY). Without a config.json (a run killed before it wrote one) the flags
  stand alone."""
  path = os.path.join(out_dir_of(cfg), CONFIG_FILE)
  try:
    with open(path) as f:
      saved = json.load(f)
  except FileNotFoundError:
    return cfg
  except (OSError, ValueError) as e:
    raise ConfigError(f"--resume: cannot read the run's settings from {path} "
                      f"({type(e).__name__}: {e})") from None
  if not isinstance(saved, dict):
    raise ConfigError(f"--resume: {path} holds no settings (a JSON object)")
  taken = {field.name: saved[field.name] for field in dataclasses.fields(TrainConfig)
           if field.name in saved and field.name not in given + PER_START}
  for field in ("sources", "prompts"):  # JSON has lists; the settings are tuples
    if isinstance(taken.get(field), list):
      taken[field] = tuple(taken[field])
  if isinstance(taken.get("bandit_config"), dict):
    taken["bandit_config"] = bandit.BanditConfig(**{
        **taken["bandit_config"],
        **{k: v for k, v in dataclasses.asdict(cfg.bandit_config).items()
           if f"bandit_{k}" in given}})
  try:
    return dataclasses.replace(cfg, **taken)
  except TypeError as e:
    raise ConfigError(f"--resume: {path} holds settings this example does not know: "
                      f"{e}") from None


def resolve(cfg: TrainConfig, platform: str | None = None) -> TrainConfig:
  """`check(cfg)` with the "auto" settings filled for `platform` ("cpu", "gpu", ...;
  default: JAX's default backend)."""
  cfg = check(cfg)
  if platform is None:
    import jax  # noqa: PLC0415 - `check` runs before jax is imported
    platform = jax.default_backend()
  return dataclasses.replace(cfg, **resolve_for_platform(cfg, platform))


def _flag(field: str) -> str:
  return "--" + field.replace("_", "-")


def _check_numbers(cfg: TrainConfig) -> None:
  """Every numeric setting in its range; a NaN or infinity anywhere is refused."""
  floats = {field.name: getattr(cfg, field.name) for field in dataclasses.fields(cfg)
            if isinstance(getattr(cfg, field.name), float)}
  floats.update({f"bandit_{k}": v for k, v in dataclasses.asdict(cfg.bandit_config).items()})
  for field, value in floats.items():
    if not math.isfinite(value):
      raise ConfigError(f"{_flag(field)} must be a finite number, got {value}")
  positive = ("steps", "batch_size", "peak_lr", "checkpoint_every", "max_source_mb",
              "sample_tokens", "nonfinite_stop", "keep_checkpoints", "log_every",
              "heartbeat_timeout_s")
  for field in positive:
    if not getattr(cfg, field) > 0:
      raise ConfigError(f"{_flag(field)} must be > 0, got {getattr(cfg, field)}")
  for field in ("warmup_steps", "weight_decay", "max_norm", "num_samples",
                "sample_temperature"):
    if getattr(cfg, field) < 0:
      raise ConfigError(f"{_flag(field)} must be >= 0, got {getattr(cfg, field)}")
  if not 0 <= cfg.end_lr_ratio <= 1:
    raise ConfigError(f"--end-lr-ratio must be in [0, 1] (the decay ends at peak-lr times "
                      f"it), got {cfg.end_lr_ratio}")
  if cfg.spike != "off" and cfg.max_norm <= 0:
    raise ConfigError(f"--spike {cfg.spike} works through the clip: it needs --max-norm > 0 "
                      f"(recipe {cfg.recipe} has {cfg.max_norm:g})")
  if not 2 <= cfg.context_length <= MAX_CONTEXT_LENGTH:
    raise ConfigError(f"--context-length must be in [2, {MAX_CONTEXT_LENGTH}], "
                      f"got {cfg.context_length}")
  if cfg.vocab_size < 257:  # the 256 byte tokens and the end-of-text token
    raise ConfigError(f"--vocab-size must be >= 257, got {cfg.vocab_size}")
  if cfg.stop_after_step is not None and not 1 <= cfg.stop_after_step <= cfg.steps:
    raise ConfigError(f"--stop-after-step must be in [1, {cfg.steps}], "
                      f"got {cfg.stop_after_step}")
  if any(not prompt.strip() for prompt in cfg.prompts):
    raise ConfigError("--prompt must not be empty")
  if cfg.resume and cfg.overwrite:
    raise ConfigError("--resume continues the run in --out-dir and --overwrite replaces it: "
                      "choose one")
  if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
    raise ConfigError(f"--peak-tflops must be > 0, got {cfg.peak_tflops}")
  if cfg.time_limit_s is not None and not cfg.time_limit_s > 0:
    raise ConfigError(f"--time-limit-s must be > 0, got {cfg.time_limit_s}")
  try:
    bandit.weights_from_rewards(np.zeros(len(corpus.SOURCE_NAMES)), cfg.bandit_config)
  except ValueError as e:
    raise ConfigError(f"--bandit-floor: {e}") from None
  if not 0 <= cfg.bandit_config.smoothing < 1:
    raise ConfigError(f"--bandit-smoothing must be in [0, 1), got {cfg.bandit_config.smoothing}")


def _check_directory(flag: str, path: str) -> None:
  """`path` is a directory, or can be made one: no file stands in its way and the
  nearest directory that exists is writable."""
  existing = os.path.abspath(os.path.expanduser(path))
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    where = "it" if existing == os.path.abspath(os.path.expanduser(path)) else existing
    raise ConfigError(f"{flag} {path}: {where} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"{flag} {path}: the directory {existing} is not writable")


def resolve_for_platform(cfg: TrainConfig, platform: str) -> dict:
  """The dtype and attention implementation of a run on `platform` ("cpu", "gpu", ...)."""
  dtype = cfg.dtype
  if dtype == "auto":
    dtype = "float32" if platform == "cpu" else "bfloat16"
  attention = cfg.attention
  if attention == "auto":
    attention = "cudnn" if platform == "gpu" and dtype == "bfloat16" else "xla"
  if attention == "cudnn" and (platform != "gpu" or dtype != "bfloat16"):
    raise ConfigError(f"--attention cudnn runs on NVIDIA GPUs in bfloat16 (cuDNN's flash "
                      f"attention); this run is on {platform} in {dtype}: use --attention "
                      "xla, or --dtype bfloat16 on a GPU")
  return {"dtype": dtype, "attention": attention}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, TrainConfig]:
  d = TrainConfig()
  presets = "\n".join(f"  {name}: " + ", ".join(f"{k} {v:g}" for k, v in preset.items())
                      for name, preset in PRESETS.items())
  recipes = "\n".join(f"  {name}: " + ", ".join(f"{k} {v:g}" for k, v in recipe.items())
                      for name, recipe in RECIPES.items())
  p = argparse.ArgumentParser(
      description="Trains the Flax GPT example with andrea_clip ahead of AdamW.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=f"settings marked * come from the recipe, else the config:\n{recipes}\n"
             f"{presets}")
  p.add_argument("--config", default=d.config, choices=CHOICES["config"],
                 help="model size (default: %(default)s)")
  p.add_argument("--recipe", default=d.recipe, choices=CHOICES["recipe"],
                 help="v2: clip + AdamW + warmup; v1: no clip, Adam, no warmup "
                      "(default: %(default)s)")
  p.add_argument("--steps", type=int, help="*")
  p.add_argument("--batch-size", type=int, help="*")
  p.add_argument("--context-length", type=int, help="*")
  p.add_argument("--peak-lr", type=float, help="*")
  p.add_argument("--warmup-steps", type=int, help="* linear warmup; step 1 gets peak / this")
  p.add_argument("--end-lr-ratio", type=float, default=d.end_lr_ratio,
                 help="the cosine decay ends at peak-lr * this (default: %(default)s)")
  p.add_argument("--weight-decay", type=float, help="* AdamW's; 0 is plain Adam")
  p.add_argument("--max-norm", type=float,
                 help="* andrea_clip's, >= 0; 0 turns clipping off")
  p.add_argument("--clip-impl", default=d.clip_impl, choices=CHOICES["clip_impl"],
                 help="andrea_clip implementation (default: %(default)s)")
  p.add_argument("--clip-mode", default=d.clip_mode, choices=CHOICES["clip_mode"],
                 help="(default: %(default)s)")
  p.add_argument("--spike", default=d.spike, choices=CHOICES["spike"],
                 help="off; zscore: clip spikes of the global norm (clipjax.ZScoreSpike) "
                      "to their threshold; skip: also skip spike and NaN/inf steps "
                      "(clipjax.skip_spikes) (default: %(default)s)")
  p.add_argument("--dtype", default=d.dtype, choices=CHOICES["dtype"],
                 help="computation dtype; parameters stay float32 (default: %(default)s: "
                      "bfloat16 on GPUs and TPUs, float32 on CPUs)")
  p.add_argument("--attention", default=d.attention, choices=CHOICES["attention"],
                 help="jax.nn.dot_product_attention's implementation (default: "
                      "%(default)s: cudnn on a GPU in bfloat16, else xla)")
  p.add_argument("--remat", default=d.remat, choices=CHOICES["remat"],
                 help="recompute each block's activations in the backward pass: all "
                      "(block), all but the matmuls' outputs (dots) (default: %(default)s)")
  p.add_argument("--mesh", metavar="data=N,fsdp=M",
                 help="device mesh: batches split over data (and fsdp), parameters and "
                      "optimizer state over fsdp (default: every visible device on data)")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="a run of several processes: process 0's address, the same for "
                      "all (default: JAX's cluster detection, else JAX_COORDINATOR_ADDRESS)")
  p.add_argument("--num-processes", type=int,
                 help="a run of several processes: how many (default: JAX's cluster "
                      "detection, else JAX_NUM_PROCESSES)")
  p.add_argument("--process-id", type=int,
                 help="a run of several processes: this one's, 0 to N-1 (default: JAX's "
                      "cluster detection, else JAX_PROCESS_ID)")
  p.add_argument("--heartbeat-timeout-s", type=int, default=d.heartbeat_timeout_s,
                 help="a run of several processes: when one dies, the others stop with "
                      "an error after this many seconds (default: %(default)s)")
  p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                 help="BPE vocabulary (default: %(default)s)")
  p.add_argument("--seed", type=int, default=d.seed,
                 help="model init, phases and data order (default: %(default)s)")
  p.add_argument("--source", action="append", default=[], metavar="NAME=PATH_OR_GLOB",
                 help=f"read a source ({', '.join(corpus.SOURCE_NAMES)}) from a file, "
                      "directory or glob: plain text (a document per file) or JSONL "
                      "(question/answer or text fields), .gz/.bz2/.xz decompressed, binary "
                      "files skipped; repeatable; sources not named use the default "
                      "corpus shipped in examples/data/")
  p.add_argument("--max-source-mb", type=float, default=d.max_source_mb,
                 help="text read per source (default: %(default)s)")
  p.add_argument("--bandit-eta", type=float, default=d.bandit_config.eta,
                 help="softmax sharpness, per nat of loss (default: %(default)s)")
  p.add_argument("--bandit-floor", type=float, default=d.bandit_config.floor,
                 help="the least weight of any source (default: %(default)s)")
  p.add_argument("--bandit-smoothing", type=float, default=d.bandit_config.smoothing,
                 help="weight of the old reward in its running mean (default: %(default)s)")
  p.add_argument("--out-dir", help="run directory (default: runs/CONFIG-RECIPE)")
  p.add_argument("--cache-dir", help="tokenizer cache (default: ~/.cache/clipjax)")
  p.add_argument("--checkpoint-every", type=int, help="* steps between checkpoints")
  p.add_argument("--resume", action="store_true",
                 help="continue from the latest checkpoint in --out-dir, with the run's "
                      "settings (its config.json) where no flag gives them")
  p.add_argument("--overwrite", action="store_true",
                 help="replace an earlier run in --out-dir (without --resume or this, a "
                      "directory that holds a run is refused)")
  p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                 help="how many of the latest checkpoints are kept (default: %(default)s)")
  p.add_argument("--stop-after-step", type=int,
                 help="stop (after a checkpoint) at this step, as if interrupted")
  p.add_argument("--time-limit-s", type=float,
                 help="end the run, with its report and samples, once this many seconds "
                      "have passed (the schedule still spans --steps)")
  p.add_argument("--log-every", type=int, default=d.log_every,
                 help="fetch the metrics from the devices every this many steps, in one "
                      "go (default: %(default)s)")
  p.add_argument("--peak-tflops", type=float,
                 help="the dense peak TFLOP/s of one device, for the MFU line (default: "
                      "known for H100 and H200 SXM: 989, bf16)")
  p.add_argument("--nonfinite-stop", type=int, default=d.nonfinite_stop,
                 help="stop after this many steps in a row whose loss or gradient norm is "
                      "NaN/inf; no checkpoint holding NaN is ever saved (default: %(default)s)")
  p.add_argument("--num-samples", type=int, default=d.num_samples,
                 help="samples generated at the end, their prompts cut from each source's "
                      "held-out text in turn (default: %(default)s)")
  p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                 help="sample from this prompt instead (repeatable: one sample each)")
  p.add_argument("--sample-tokens", type=int, default=d.sample_tokens,
                 help="(default: %(default)s)")
  p.add_argument("--sample-temperature", type=float, default=d.sample_temperature,
                 help="0 is greedy (default: %(default)s)")
  p.add_argument("--no-plot", dest="plot", action="store_false", help="skip report.png")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="no progress bar")
  args = vars(p.parse_args(argv))
  given = _given_flags(p, argv, args)
  args["sources"] = tuple(args.pop("source"))
  args["prompts"] = tuple(args.pop("prompt"))
  args["bandit_config"] = bandit.BanditConfig(
      eta=args.pop("bandit_eta"), floor=args.pop("bandit_floor"),
      smoothing=args.pop("bandit_smoothing"))
  cfg = TrainConfig(**args)
  if cfg.resume:
    try:
      cfg = resumed(cfg, given)
    except ConfigError as e:
      p.exit(2, f"{p.prog}: error: {e}\n")
  return p, cfg


def _given_flags(p: argparse.ArgumentParser, argv: list[str] | None, args: dict) -> tuple:
  """The settings that `argv` gives, as TrainConfig fields ("sources", "prompts") and
  bandit_eta, bandit_floor, bandit_smoothing: `args` parsed again, each default replaced
  by a marker (a repeatable flag is given where its list is not empty)."""
  defaults = {dest: p.get_default(dest) for dest in args}
  not_given = object()
  p.set_defaults(**{dest: not_given for dest, value in defaults.items() if value != []})
  try:
    again = vars(p.parse_args(argv))
  finally:
    p.set_defaults(**defaults)
  return tuple({"source": "sources", "prompt": "prompts"}.get(dest, dest)
               for dest, value in again.items() if value is not not_given and value != [])
