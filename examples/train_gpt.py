"""Trains the GPT on the bandit-mixed sources with andrea_clip ahead of AdamW.

    python examples/train_gpt.py --config tiny                # CPU, a few minutes
    python examples/train_gpt.py --config andrea-12m --source gutenberg=books/*.txt
    python examples/train_gpt.py --config andrea-120m --recipe v1   # no clip, Adam
    python examples/train_gpt.py --mesh data=2,fsdp=4   # 8 devices: data parallel x FSDP
    srun python examples/train_gpt.py --config andrea-120m   # one process per task (SLURM)

`--help` lists every flag. The modules are the package gpt/ beside this file (gpt/__init__.py
says where each job lives); `gpt.training.loop.train(cfg)` runs the same from Python.
"""

import sys

from gpt import config, flags
from gpt.data import corpus


def main(argv: list[str] | None = None) -> None:
  """Runs the flags' training; a bad flag, source or run directory is one error line.
  Every flag is checked before jax is imported, which takes a while."""
  parser, cfg = flags.parse_args(argv)
  try:
    cfg = config.check(cfg)
  except (config.ConfigError, corpus.SourceError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  from gpt.training import distributed, loop  # noqa: PLC0415 - these import jax
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
