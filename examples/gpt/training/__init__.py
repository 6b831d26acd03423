"""The training run: the loop, its step, and what keeps a run going.

  loop.py         the training run: `loop.train(TrainConfig(...))` from Python
  steps.py        the steps in order: the jitted step, metrics in groups, checkpoints
  train_step.py   the optimizer (andrea_clip ahead of AdamW) and the jitted, donated step
  checkpoint.py   Orbax checkpoints, checked restore with fallback
  run_dir.py      the run directory: an earlier run refused, or set aside until replaced
  distributed.py  a run of several processes: launch, process 0's writes
  sharding.py     the device mesh (--mesh) and where each array lives on it
  status.py       status lines for the slow steps
"""
