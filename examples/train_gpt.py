"""Trains the GPT on the bandit-mixed sources with andrea_clip ahead of AdamW.

    python examples/train_gpt.py --config tiny                # CPU, a few minutes
    python examples/train_gpt.py --config andrea-12m --source gutenberg=books/*.txt
    python examples/train_gpt.py --config andrea-120m --recipe v1   # no clip, Adam
    python examples/train_gpt.py --mesh data=2,fsdp=4   # 8 devices: data parallel x FSDP
    srun python examples/train_gpt.py --config andrea-120m   # one process per task (SLURM)

`--help` lists every flag. The files of the example, each with one job:

  config.py          every setting, the presets and recipes, the flags
  corpus.py          the sources: the user's files, held-out text, sample prompts
  default_corpus.py  the default corpus: fixed, versioned files in data/
  tokenizer.py       BPE training, the cache, token streams
  bandit.py          phases and the EXP3 weights
  pipeline.py        batch sampling on a thread, the device batches a step ahead
  model.py           the GPT and its three sizes
  train_step.py      the optimizer and the jitted, donated step
  sharding.py        the device mesh (--mesh) and where each array lives on it
  distributed.py     a run of several processes: launch, process 0's writes
  run_dir.py         the run directory: its lock, an earlier run refused or set aside
  loop.py            the training run: `loop.train(TrainConfig(...))` from Python
  steps.py           the steps in order: the jitted step, metrics in groups, checkpoints
  throughput.py      FLOPs per token, the devices' peak, MFU
  metrics.py         the metrics log and atomic file writes
  checkpoint.py      Orbax checkpoints, checked restore with fallback
  report.py          summary.json, the plot, samples and their repetition scores
  status.py          status lines for the slow steps
"""

import sys

import config
import corpus


def main(argv: list[str] | None = None) -> None:
  """Runs the flags' training; a bad flag, source or run directory is one error line.
  Every flag is checked before jax is imported, which takes a while."""
  parser, cfg = config.parse_args(argv)
  try:
    cfg = config.check(cfg)
  except (config.ConfigError, corpus.SourceError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  import distributed  # noqa: PLC0415 - these import jax
  import loop  # noqa: PLC0415
  with distributed.exit_on_error(), distributed.handle_stop_signals():
    try:
      loop.train(cfg)
    except loop.USER_ERRORS as e:  # one line (argparse's own errors also print the usage)
      parser.exit(2, f"{parser.prog}: error: {e}\n")
    except loop.TrainingDiverged as e:
      sys.exit(f"train_gpt.py: {e}")
    except loop.Stopped as e:
      print(f"train_gpt.py: {e}", file=sys.stderr, flush=True)
      sys.exit(distributed.stop_exit_status())


if __name__ == "__main__":
  main()
