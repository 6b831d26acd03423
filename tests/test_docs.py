"""The documentation's rules: no history in prose, its size, its API page and its records
(those the docs hold, and one a benchmark writes).

The getting-started page's Python blocks run here, on the CPU, as a reader would run them.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re

import jax
import pytest
from benchlib import record

import clipjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
HAND_WRITTEN_DOCS = sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))
READMES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "README.md")]
PROSE = HAND_WRITTEN_DOCS + READMES + [os.path.join(ROOT, "CHANGELOG.md")]

# A commit hash: 7 to 40 hex digits, standing alone, with both a digit and a letter (a
# number or a word made of a-f is not one).
HEX_RUN = re.compile(r"(?<![0-9A-Za-z_])[0-9a-fA-F]{7,40}(?![0-9A-Za-z_])")
ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def load_make_results():
  spec = importlib.util.spec_from_file_location("make_results",
                                                os.path.join(DOCS, "make_results.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


make_results = load_make_results()


def commit_hashes(text):
  return [m for m in HEX_RUN.findall(text)
          if any(c.isdigit() for c in m) and any(c.isalpha() for c in m)]


def read(path):
  with open(path) as f:
    return f.read()


def python_blocks(markdown):
  return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def test_commit_hashes_are_found_and_numbers_and_words_are_not():
  assert commit_hashes("at commit 67a819f, then e5844f4c27edda1") == ["67a819f", "e5844f4c27edda1"]
  assert commit_hashes("574c3d2b" + "0" * 32) == ["574c3d2b" + "0" * 32]
  assert commit_hashes("1234567 tokens, a facade, deadbeef, 0xdeadbeef0, 3.14159265") == []
  assert commit_hashes("a 12345a-long id_1234abc x1234abcd") == []    # 6 digits, joined words
  assert commit_hashes("a" * 7 + "1" * 34) == []                       # 41 hex digits


@pytest.mark.parametrize("path", PROSE, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_commit_hash_or_date_in_prose(path):
  text = read(path)
  assert commit_hashes(text) == [], f"{os.path.relpath(path, ROOT)} names commits"
  assert ISO_DATE.findall(text) == [], f"{os.path.relpath(path, ROOT)} holds dates"


def test_the_hand_written_docs_and_readmes_keep_to_their_size():
  lines = sum(len(read(p).splitlines()) for p in HAND_WRITTEN_DOCS)
  assert lines <= 1500, f"docs/*.md hold {lines} lines"
  assert os.path.getsize(READMES[0]) <= 6000
  assert os.path.getsize(READMES[1]) <= 8000


def test_the_api_page_lists_every_public_name_once():
  text = read(os.path.join(DOCS, "api.md"))
  listed = re.findall(r"^   ([A-Za-z_][A-Za-z0-9_]*)$", text, flags=re.M)
  assert sorted(listed) == sorted(clipjax.__all__)


def test_every_page_is_in_the_table_of_contents():
  index = read(os.path.join(DOCS, "index.md"))
  pages = {os.path.basename(p)[:-3] for p in HAND_WRITTEN_DOCS} - {"index"}
  in_toc = set(re.findall(r"^([a-z_]+)$", index, flags=re.M))
  assert pages == in_toc


def test_every_record_has_its_command_date_device_versions_and_commit():
  records = make_results.load_records()
  assert len(records) >= 2
  for name, record in records.items():
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", record["date"]), name
    assert re.fullmatch(r"[0-9a-f]{7,40}", record["commit"]), name
    assert record["versions"] and record["device"] and record["command"], name


def test_a_record_without_its_fields_or_with_a_short_row_is_refused(tmp_path):
  record = {"title": "t", "command": "c", "date": "2026-01-01", "device": "d",
            "versions": {"jax": "0"}, "commit": "abc1234",
            "tables": [{"name": "main", "columns": ["a", "b"], "rows": [[1, 2]]}]}
  (tmp_path / "good.json").write_text(json.dumps(record))
  assert list(make_results.load_records(str(tmp_path))) == ["good"]
  record["tables"][0]["rows"].append([3])
  (tmp_path / "good.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match=r"good\.json: table 'main' has a row of 1 cells"):
    make_results.load_records(str(tmp_path))
  del record["commit"]
  (tmp_path / "good.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match=r"good\.json: the record lacks commit"):
    make_results.load_records(str(tmp_path))


def test_a_record_a_benchmark_writes_is_rendered_as_it_is(tmp_path):
  args = argparse.Namespace(quick=True, out=str(tmp_path / "bench_x.json"))
  rows = [{"leaves": 3, "impl": "ffi", "ms": 0.25}, {"leaves": 3, "impl": "jax", "ms": 0.5,
                                                      "note": "slower"}]
  record.save_rows("bench_x", args, rows, checks=[{"what": "norm", "ok": True}], goal=2.0)
  [(name, rendered)] = make_results.load_records(str(tmp_path)).items()
  assert name == "bench_x" and rendered["title"] == "bench_x"
  assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", rendered["date"])
  assert rendered["device"] == f"{jax.device_count()}x {jax.devices()[0].device_kind}"
  assert rendered["versions"]["jax"] == jax.__version__
  assert rendered["commit"] == record.git_commit()
  markdown = make_results.record_markdown(rendered)
  assert ("| leaves | impl | ms | note |\n|---|---|---|---|\n| 3 | ffi | 0.25 | - |\n"
          "| 3 | jax | 0.5 | slower |") in markdown
  assert "| what | ok |\n|---|---|\n| norm | true |" in markdown
  assert rendered["command"] in markdown


def test_an_unfinished_benchmark_run_is_refused(tmp_path):
  path = tmp_path / "bench_x.json"
  meta = record.run_metadata(argparse.Namespace(out=str(path)))
  record.save_json({"meta": meta, "rows": [{"ms": 1.0}]}, str(path), complete=False)
  with pytest.raises(ValueError, match=r"bench_x\.json: the run did not finish"):
    make_results.load_records(str(tmp_path))


def test_cells_are_written_as_a_reader_expects():
  assert [make_results.cell(v) for v in (None, 615842, 9999, 0.0369, 1.58e-7, "x", True)] == [
      "-", "615,842", "9999", "0.0369", "1.58e-07", "x", "true"]
  assert make_results.markdown_table(["a", "b"], [[1, None]]) == "| a | b |\n|---|---|\n| 1 | - |"
  assert make_results.cell([1.5, 20000]) == "1.5, 20,000"  # a benchmark's list of rounds


def test_the_pages_include_only_generated_tables_and_figures_that_exist(tmp_path):
  pytest.importorskip("matplotlib", reason="the figures need the docs extra's matplotlib")
  written = {os.path.basename(p) for p in make_results.main(str(tmp_path))}
  for path in HAND_WRITTEN_DOCS:
    for target in re.findall(r"_generated/([a-z0-9_]+\.(?:md|png))", read(path)):
      assert target in written, f"{os.path.basename(path)} includes {target}"
  for figure in make_results.FIGURES:
    assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  experiments = read(os.path.join(DOCS, "experiments.md"))
  assert len(re.findall(r"!\[[^]]*\]\(_generated/[a-z_]+\.png\)", experiments)) >= 2


def test_the_readme_table_is_the_one_its_record_makes():
  table = make_results.readme_table(make_results.load_records())
  assert table in read(READMES[0])


def test_the_getting_started_code_runs_on_the_cpu():
  blocks = python_blocks(read(os.path.join(DOCS, "getting_started.md")))
  assert len(blocks) >= 3
  namespace = {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    for block in blocks:
      exec(compile(block, "getting_started.md", "exec"), namespace)
  printed = out.getvalue().splitlines()
  assert printed[-1] == "5.0"                                  # the norm of [3, 4]
  assert "clip" in namespace and bool(namespace["result"].clipped)
