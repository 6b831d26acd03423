"""The GPT example as a package: the settings and the model here, the rest by concern.

  config.py   every setting, the presets and recipes, their checks
  flags.py    the command line: a flag for each setting
  model.py    the GPT and its three sizes
  data/       the sources, the tokenizer, the bandit, the batches
  training/   the training loop: the step, checkpoints, the run directory, processes, mesh
  reports/    the metrics log, throughput, the end-of-run report

examples/train_gpt.py is the entry point; `gpt.training.loop.train(cfg)` runs the same from
Python.
"""
