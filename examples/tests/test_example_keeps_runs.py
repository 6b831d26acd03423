"""The example never loses a run: no flag, typo, bad source or mistaken resume deletes or
moves a finished run's files. Each case takes a copy of one finished run, does what the
user did, and compares the run directory's contents before and after."""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from gpt import config
from gpt.reports import metrics
from gpt.training import checkpoint, loop, run_dir as run_dir_lib, steps

EXAMPLES = pathlib.Path(__file__).resolve().parents[1]
STEPS = 6  # checkpoints at 2, 4 and 6; the last two kept


def contents(directory) -> dict:
  """{relative path: SHA-256} of every file below `directory`."""
  found = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        found[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return found


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny):
  """(cfg, directory) of one finished run, never changed: tests work on copies."""
  cfg = tiny(tmp_path_factory.mktemp("finished"), steps=STEPS, checkpoint_every=2)
  loop.train(cfg)
  return cfg, cfg.out_dir


@pytest.fixture
def copy(finished, tmp_path):
  """(cfg, directory, contents) of a fresh copy of the finished run."""
  cfg, directory = finished
  out = tmp_path / "run"
  shutil.copytree(directory, out)
  return dataclasses.replace(cfg, out_dir=str(out)), out, contents(out)


def flags(cfg, *extra) -> list[str]:
  """train_gpt.py's flags for `cfg`, then `extra`."""
  return ["--config", "tiny", "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size),
          "--context-length", str(cfg.context_length), "--vocab-size", str(cfg.vocab_size),
          "--peak-lr", str(cfg.peak_lr), "--warmup-steps", str(cfg.warmup_steps),
          "--max-source-mb", str(cfg.max_source_mb), "--checkpoint-every", "2",
          "--out-dir", cfg.out_dir, "--cache-dir", cfg.cache_dir, "--num-samples", "0",
          "--no-plot", "--no-progress", *extra]


# --- 3. Bad flags: one line at parse time, before jax is imported --------------------

_PARSE_ONLY = """
import json, sys
import train_gpt  # python -c finds it in its working directory, examples/
results = []
for argv in json.loads(sys.argv[1]):
  try:
    train_gpt.main(argv)
    code = None
  except SystemExit as e:
    code = e.code
  results.append(code)
print(json.dumps({"codes": results, "jax_imported": "jax" in sys.modules}))
"""


def test_bad_flags_fail_at_once_without_jax_and_touch_nothing(copy, tmp_path):
  cfg, out, before = copy
  a_file = tmp_path / "a-file"
  a_file.write_text("not a directory")
  bad = {
      "--bandit-eta must be a finite number, got nan": ["--bandit-eta", "nan"],
      "--max-norm must be a finite number, got nan": ["--max-norm", "nan"],
      "--peak-lr must be a finite number, got inf": ["--peak-lr", "inf"],
      "--end-lr-ratio must be in [0, 1]": ["--end-lr-ratio", "-1"],
      "--context-length must be in [2, 8192], got 100000": ["--context-length", "100000"],
      f"--out-dir {a_file}/run: {a_file} is a file, not a directory":
          ["--out-dir", f"{a_file}/run"],
      f"--cache-dir {a_file}: it is a file, not a directory": ["--cache-dir", str(a_file)],
      "unknown source 'gutenbrg'": ["--source", "gutenbrg=books.txt"],
      "source 'gutenberg': no file matches '/nope.txt.gz'": ["--source", "gutenberg=/nope.txt.gz"],
      "argument --steps: invalid int value: 'six'": ["--steps", "six"],
  }
  argvs = [flags(cfg, "--overwrite", *extra) for extra in bad.values()] + [["--help"]]
  run = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps(argvs)], cwd=EXAMPLES,
                       capture_output=True, text=True, check=True)
  result = json.loads(run.stdout.splitlines()[-1])
  assert result == {"codes": [2] * len(bad) + [0], "jax_imported": False}
  errors = [line for line in run.stderr.splitlines() if ": error: " in line]
  assert len(errors) == len(bad)  # one line each
  for message, line in zip(bad, errors):
    assert message in line, line
  assert "usage: " in run.stdout  # --help
  assert contents(out) == before


# --- 1. --overwrite checks and builds everything first, and replaces the run last ----


@pytest.mark.parametrize("problem", ["binary", "null-text"])
def test_an_overwrite_whose_data_fails_leaves_the_run(copy, tmp_path, problem):
  cfg, out, before = copy
  source = tmp_path / "source"
  source.mkdir()
  if problem == "binary":
    (source / "a.so").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(4000))
    message = r"source 'gutenberg': no usable text"
  else:
    (source / "qa.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    message = r"qa.jsonl:2: the 'text' field is null, not a string"
  with pytest.raises(Exception, match=message):
    loop.train(dataclasses.replace(cfg, overwrite=True, sources=(f"gutenberg={source}",)))
  assert contents(out) == before


def test_an_overwrite_stopped_before_its_first_checkpoint_puts_the_run_back(
    copy, monkeypatch):
  cfg, out, before = copy
  real = steps.fetch_metrics

  def interrupted(the_loop, state, keep_latest=False):
    if any(step == 3 for step, _, _ in state.pending):
      assert os.path.isdir(out / run_dir_lib.ASIDE)  # the earlier run, set aside
      raise KeyboardInterrupt  # Ctrl-C once step 3 ran, before the checkpoint at 4
    real(the_loop, state, keep_latest)

  monkeypatch.setattr(steps, "fetch_metrics", interrupted)
  with pytest.raises(KeyboardInterrupt):
    loop.train(dataclasses.replace(cfg, overwrite=True, checkpoint_every=4))
  assert contents(out) == before


def test_a_kill_during_an_overwrite_is_undone_when_the_directory_is_next_opened(copy, capsys):
  cfg, out, before = copy
  run_dir_lib.open_run_dir(str(out), resume=False, overwrite=True, say=print)
  (out / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n')  # the new run's start
  (out / "config.json").write_text("{}")
  # ... and the process is killed here: no restore_earlier, no keep_new.
  assert set(contents(out)) != set(before)
  records = loop.train(dataclasses.replace(cfg, resume=True))  # the next start
  assert "restored the earlier run" in capsys.readouterr().out
  assert len(metrics.step_records(records)) == STEPS
  assert set(contents(out)) == set(before)
  assert not (out / run_dir_lib.ASIDE).exists()


def test_an_overwrite_replaces_the_run_once_it_has_a_checkpoint(copy):
  cfg, out, before = copy
  loop.train(dataclasses.replace(cfg, overwrite=True, steps=4, stop_after_step=2))
  assert not (out / run_dir_lib.ASIDE).exists()
  assert not (out / "summary.json").exists()  # the earlier run's files are gone
  assert [r["step"] for r in metrics.step_records(
      metrics.read_records(str(out / "metrics.jsonl")))] == [1, 2]


# --- 2. A resume with other settings, or with no checkpoint, moves nothing -----------


def test_a_resume_with_a_shape_changing_flag_is_refused_and_moves_nothing(copy):
  cfg, out, before = copy
  with pytest.raises(config.ConfigError, match=r"--resume: the checkpoint in .* was made "
                     r"with other settings: context_length=32 \(now 16\)"):
    loop.train(dataclasses.replace(cfg, resume=True, context_length=16))
  assert contents(out) == before
  records = loop.train(dataclasses.replace(cfg, resume=True))  # the right flags still work
  assert len(metrics.step_records(records)) == STEPS


def test_only_damage_sets_a_checkpoint_aside(copy, capsys):
  cfg, out, _ = copy
  (out / "checkpoints" / str(STEPS) / checkpoint.CHECKSUMS).write_text("{")  # unreadable
  records = loop.train(dataclasses.replace(cfg, resume=True))
  assert f"checkpoint {out / 'checkpoints' / str(STEPS)} is unusable" in capsys.readouterr().out
  assert (out / "checkpoints-unusable" / str(STEPS)).is_dir()
  assert len(metrics.step_records(records)) == STEPS  # steps 5 and 6 again, from 4


def test_a_resume_that_finds_no_checkpoint_keeps_the_metrics(copy):
  cfg, out, _ = copy
  shutil.rmtree(out / "checkpoints")
  before = contents(out)
  with pytest.raises(config.ConfigError, match=r"has no checkpoint to continue from, and "
                     r".*metrics.jsonl holds \d+ records .* pass --overwrite"):
    loop.train(dataclasses.replace(cfg, resume=True))
  assert contents(out) == before


# --- 6. A damaged line inside metrics.jsonl ------------------------------------------


def test_a_damaged_metrics_line_is_set_aside_and_the_good_lines_kept(copy, capsys):
  cfg, out, _ = copy
  path = out / "metrics.jsonl"
  lines = path.read_text().splitlines()
  lines[4] = lines[4][:20] + "#garbage"
  path.write_text("\n".join(lines) + "\n")
  records = loop.train(dataclasses.replace(cfg, resume=True))
  out_lines = capsys.readouterr().out
  assert f"warning: {path}: 1 damaged line(s) (first: line 5) moved to {path}.damaged" in out_lines
  assert [json.dumps(r) for r in records] == lines[:4] + lines[5:]  # every good line
  assert (out / "metrics.jsonl.damaged").read_text() == f"{path}:5: {lines[4]}\n"
