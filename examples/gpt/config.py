"""Every setting of a training run, its defaults per config and recipe, and its checks.

A TrainConfig field left None is filled by `check`: from the recipe first (RECIPES),
then from the config's preset (PRESETS); an explicit value always wins. The andrea
presets follow the ANDREA documents (peak lr 3e-4, a 2000-step warmup, so step 1 has lr
1.5e-7); `tiny` uses a higher peak and a short warmup so it learns within minutes on a
CPU. "auto" settings (dtype, attention) are resolved for the platform the run is on.
"""

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
