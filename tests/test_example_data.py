"""The example's sources and tokenizer (examples/corpus.py, tokenizer.py)."""

import json
import os
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import corpus  # noqa: E402
import tokenizer as tokenizer_lib  # noqa: E402

SMALL_CORPUS = {
    "repo-docs": ["# clipjax\n\n- global norm\n- per tensor norm\n- three kernels\n"] * 20,
    "gutenberg": ["It was the best of times, it was the worst of times. " * 10] * 5,
    "hermes3-general": [corpus.format_qa("What is 2 + 2?", "It is 4.")] * 20,
}


# --- --source flags and files -------------------------------------------------------


def test_source_flags_parse():
  assert corpus.parse_source_flags(["gutenberg=books/*.txt", "repo-docs=docs"]) == {
      "gutenberg": "books/*.txt", "repo-docs": "docs"}


@pytest.mark.parametrize("flag, message", [
    ("wikipedia=x.txt", "unknown source 'wikipedia'"),
    ("gutenberg", "expected NAME=PATH_OR_GLOB"),
    ("gutenberg=", "expected NAME=PATH_OR_GLOB"),
])
def test_bad_source_flags_are_named(flag, message):
  with pytest.raises(corpus.SourceError, match=message):
    corpus.parse_source_flags([flag])


def test_a_source_given_twice_is_an_error():
  with pytest.raises(corpus.SourceError, match="'gutenberg' is given twice"):
    corpus.parse_source_flags(["gutenberg=a", "gutenberg=b"])


def test_a_pattern_matching_nothing_names_the_source_and_pattern(tmp_path):
  pattern = str(tmp_path / "missing" / "*.txt")
  with pytest.raises(corpus.SourceError, match=r"source 'gutenberg': no file matches .*missing"):
    corpus.load_corpus({"gutenberg": pattern}, 1 << 20)


@pytest.mark.parametrize("content", ["", "\n  \n"])
@pytest.mark.parametrize("filename", ["empty.txt", "empty.jsonl"])
def test_an_empty_file_names_the_source_and_file(tmp_path, filename, content):
  path = tmp_path / filename
  path.write_text(content)
  with pytest.raises(corpus.SourceError, match=f"source 'repo-docs': file .*{filename} is empty"):
    corpus.load_corpus({"repo-docs": str(path)}, 1 << 20)


def test_jsonl_question_answer_and_text_records(tmp_path):
  path = tmp_path / "qa.jsonl"
  path.write_text(json.dumps({"question": "Why clip?", "answer": "To stop spikes."}) + "\n\n"
                  + json.dumps({"text": "Plain text."}) + "\n")
  docs = list(corpus.read_source_files("hermes3-general", str(path)))
  assert docs == ["Question: Why clip?\nAnswer: To stop spikes.", "Plain text."]


@pytest.mark.parametrize("line, message", [
    ('{"question": "q"}', "expected an object with 'question' and 'answer'"),
    ("not json", "not valid JSON"),
])
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "ok"}\n' + line + "\n")
  with pytest.raises(corpus.SourceError, match=f"'hermes3-general': .*bad.jsonl:2: {message}"):
    list(corpus.read_source_files("hermes3-general", str(path)))


def test_a_directory_or_glob_reads_files_in_sorted_order(tmp_path):
  for name in ["b.txt", "a.txt", "sub/c.txt"]:
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(f"text of {name}")
  docs = list(corpus.read_source_files("gutenberg", str(tmp_path)))
  assert docs == ["text of a.txt", "text of b.txt", "text of sub/c.txt"]
  assert list(corpus.read_source_files("gutenberg", str(tmp_path / "*.txt"))) == docs[:2]


def test_user_files_replace_only_their_source(tmp_path):
  (tmp_path / "book.txt").write_text("Call me Ishmael. " * 30)
  texts = corpus.load_corpus({"gutenberg": str(tmp_path / "book.txt")}, 4096)
  assert texts["gutenberg"] == ["Call me Ishmael. " * 30]
  assert texts["repo-docs"] and texts["hermes3-general"]


def test_the_byte_cap_cuts_the_corpus():
  texts = corpus.load_corpus({}, 3000)
  for docs in texts.values():
    assert 0 < sum(len(d.encode()) for d in docs) <= 3000


# --- The default corpus -------------------------------------------------------------


def test_default_corpus_has_three_forms_and_is_deterministic():
  texts = corpus.load_corpus({}, 200_000)
  assert texts == corpus.load_corpus({}, 200_000)
  assert set(texts) == set(corpus.SOURCE_NAMES)
  for docs in texts.values():
    assert sum(len(d) for d in docs) > 50_000
  qa = texts["hermes3-general"]
  assert all(d.startswith("Question: What ") and "\nAnswer: " in d for d in qa)
  assert any(d.startswith("Question: What does `abc.abstractmethod` do?") for d in qa)


# --- Tokenizer ----------------------------------------------------------------------


def test_tokenizer_round_trips_text(tmp_path):
  tokenizer, _, _ = tokenizer_lib.load_tokenizer_and_streams(SMALL_CORPUS, 300, str(tmp_path))
  assert tokenizer.get_vocab_size() <= 300
  for text in ["It was the best of times.", "- per tensor norm\n", "Ünïcödé ✓ 日本 \t\n"]:
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_streams_end_every_document_with_end_of_text(tmp_path):
  tokenizer, streams, _ = tokenizer_lib.load_tokenizer_and_streams(
      SMALL_CORPUS, 300, str(tmp_path))
  eot = tokenizer.token_to_id(tokenizer_lib.END_OF_TEXT)
  for name, docs in SMALL_CORPUS.items():
    assert streams[name].dtype == np.int32
    assert (streams[name] == eot).sum() == len(docs)
    assert streams[name][-1] == eot
    first_doc = streams[name][:np.argmax(streams[name] == eot)]
    assert tokenizer.decode(first_doc.tolist()) == docs[0]


def test_tokenizer_is_cached_by_a_hash_of_the_corpus(tmp_path):
  tokenizer_lib.load_tokenizer_and_streams(SMALL_CORPUS, 300, str(tmp_path))
  files = sorted(os.listdir(tmp_path))
  assert len(files) == 2
  mtimes = [os.path.getmtime(tmp_path / f) for f in files]
  tokenizer_lib.load_tokenizer_and_streams(SMALL_CORPUS, 300, str(tmp_path))  # reused
  assert [os.path.getmtime(tmp_path / f) for f in files] == mtimes
  changed = {**SMALL_CORPUS, "gutenberg": ["A different book entirely. " * 20]}
  tokenizer_lib.load_tokenizer_and_streams(changed, 300, str(tmp_path))
  tokenizer_lib.load_tokenizer_and_streams(SMALL_CORPUS, 280, str(tmp_path))
  assert len(os.listdir(tmp_path)) == 6  # a new key for new text and for a new size
  assert (tokenizer_lib.corpus_key(SMALL_CORPUS, 300)
          != tokenizer_lib.corpus_key(changed, 300)
          != tokenizer_lib.corpus_key(changed, 280))
