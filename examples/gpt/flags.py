"""The command line of train_gpt.py: a flag for each setting of gpt/config.py's TrainConfig.

`parse_args` turns the flags into a TrainConfig; with --resume, the settings no flag gives
come from the run's config.json (config.resumed).
"""

import argparse

from . import config
from .data import bandit, corpus


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, config.TrainConfig]:
  d = config.TrainConfig()
  presets = "\n".join(f"  {name}: " + ", ".join(f"{k} {v:g}" for k, v in preset.items())
                      for name, preset in config.PRESETS.items())
  recipes = "\n".join(f"  {name}: " + ", ".join(f"{k} {v:g}" for k, v in recipe.items())
                      for name, recipe in config.RECIPES.items())
  p = argparse.ArgumentParser(
      description="Trains the Flax GPT example with andrea_clip ahead of AdamW.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=f"settings marked * come from the recipe, else the config:\n{recipes}\n"
             f"{presets}")
  p.add_argument("--config", default=d.config, choices=config.CHOICES["config"],
                 help="model size (default: %(default)s)")
  p.add_argument("--recipe", default=d.recipe, choices=config.CHOICES["recipe"],
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
  p.add_argument("--clip-impl", default=d.clip_impl, choices=config.CHOICES["clip_impl"],
                 help="andrea_clip implementation (default: %(default)s)")
  p.add_argument("--clip-mode", default=d.clip_mode, choices=config.CHOICES["clip_mode"],
                 help="(default: %(default)s)")
  p.add_argument("--spike", default=d.spike, choices=config.CHOICES["spike"],
                 help="off; zscore: clip spikes of the global norm (clipjax.ZScoreSpike) "
                      "to their threshold; skip: also skip spike and NaN/inf steps "
                      "(clipjax.skip_spikes) (default: %(default)s)")
  p.add_argument("--dtype", default=d.dtype, choices=config.CHOICES["dtype"],
                 help="computation dtype; parameters stay float32 (default: %(default)s: "
                      "bfloat16 on GPUs and TPUs, float32 on CPUs)")
  p.add_argument("--attention", default=d.attention, choices=config.CHOICES["attention"],
                 help="jax.nn.dot_product_attention's implementation (default: "
                      "%(default)s: cudnn on a GPU in bfloat16, else xla)")
  p.add_argument("--remat", default=d.remat, choices=config.CHOICES["remat"],
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
  cfg = config.TrainConfig(**args)
  if cfg.resume:
    try:
      cfg = config.resumed(cfg, given)
    except config.ConfigError as e:
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
