"""The example's sources and tokenizer (corpus.py, default_corpus.py, tokenizer.py), on
small temporary files."""

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil

import numpy as np
import pytest

from gpt.data import corpus, default_corpus, tokenizer as tokenizer_lib

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
def test_a_source_with_no_text_names_the_source_and_file(tmp_path, filename, content, capsys):
  path = tmp_path / filename
  path.write_text(content)
  with pytest.raises(corpus.SourceError, match=f"source 'repo-docs': no usable text in "
                     f"'.*{filename}'; skipped .*{filename} \\(no text\\)"):
    corpus.load_corpus({"repo-docs": str(path)}, 1 << 20)
  assert capsys.readouterr().out == (
      f"warning: source 'repo-docs': skipping {path}: no text\n")


def test_jsonl_question_answer_and_text_records(tmp_path):
  path = tmp_path / "qa.jsonl"
  path.write_text(json.dumps({"question": "Why clip?", "answer": "To stop spikes."}) + "\n\n"
                  + json.dumps({"text": "Plain text."}) + "\n")
  docs = list(corpus.read_source_files("hermes3-general", str(path)))
  assert docs == ["Question: Why clip?\nAnswer: To stop spikes.", "Plain text."]


@pytest.mark.parametrize("filename", ["qa.json", "qa.txt", "qa"])
def test_jsonl_is_recognised_by_its_content_not_its_name(tmp_path, filename):
  path = tmp_path / filename
  path.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(3)) + "\n")
  assert list(corpus.read_source_files("hermes3-general", str(path))) == [
      "document 0", "document 1", "document 2"]


def test_a_json_document_over_many_lines_is_plain_text(tmp_path):
  path = tmp_path / "config.json"
  path.write_text('{\n  "text": "not one record a line"\n}\n')
  assert list(corpus.read_source_files("repo-docs", str(path))) == [path.read_text()]


@pytest.mark.parametrize("line, message", [
    ('{"question": "q"}', "expected an object with 'question' and 'answer'"),
    ("not json", "not valid JSON"),
])
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "ok"}\n' + line + "\n")
  with pytest.raises(corpus.SourceError, match=f"'hermes3-general': .*bad.jsonl:2: {message}"):
    list(corpus.read_source_files("hermes3-general", str(path)))


COMPRESSORS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_compressed_text_and_jsonl_are_decompressed(tmp_path, suffix):
  book = "Call me Ishmael. Some years ago, never mind how long precisely. " * 20
  (tmp_path / f"a-book.txt{suffix}").write_bytes(COMPRESSORS[suffix](book.encode()))
  qa = json.dumps({"question": "Why clip?", "answer": "To stop spikes."}) + "\n"
  (tmp_path / f"b-qa.jsonl{suffix}").write_bytes(COMPRESSORS[suffix](qa.encode()))
  assert list(corpus.read_source_files("gutenberg", str(tmp_path))) == [
      book, "Question: Why clip?\nAnswer: To stop spikes."]


def test_a_file_that_does_not_decompress_is_skipped_and_named(tmp_path, capsys):
  (tmp_path / "a.txt.gz").write_bytes(b"this was never gzipped")
  (tmp_path / "b.txt").write_text("The text that is left.")
  assert list(corpus.read_source_files("gutenberg", str(tmp_path))) == [
      "The text that is left."]
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith(
      f"warning: source 'gutenberg': skipping {tmp_path / 'a.txt.gz'}: does not decompress "
      "as .gz")


def _png() -> bytes:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig = plt.figure(figsize=(1, 1))
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  plt.close(fig)
  return buffer.getvalue()


def _shared_library() -> bytes:
  import clipjax._clipjax_cpu  # noqa: PLC0415
  with open(clipjax._clipjax_cpu.__file__, "rb") as f:
    return f.read()


@pytest.mark.parametrize("kind, why", [
    ("png", r"binary \(\d+\.\d% of its bytes are control bytes, \d+ of them NUL\)"),
    ("shared library", r"binary \(\d+\.\d% of its bytes are control bytes, \d+ of them NUL\)"),
    ("latin-1 bytes", r"binary \(90% of its bytes are not UTF-8\)"),
])
def test_a_binary_file_is_skipped_with_one_warning_naming_it(tmp_path, capsys, kind, why):
  data = {"png": _png, "shared library": _shared_library,
          "latin-1 bytes": lambda: bytes(range(128, 256)) + b"some ASCII too"}[kind]()
  (tmp_path / "a.bin").write_bytes(data)
  (tmp_path / "b.txt").write_text("Plain prose.")
  assert list(corpus.read_source_files("gutenberg", str(tmp_path))) == ["Plain prose."]
  out = capsys.readouterr().out
  skipped = re.escape(str(tmp_path / "a.bin"))
  assert re.fullmatch(f"warning: source 'gutenberg': skipping {skipped}: {why}\n", out), out


def test_text_with_a_few_nul_and_control_bytes_is_read(tmp_path):
  # As a GNU info manual: a \x1f before every node, and two stray NULs in the text.
  nodes = [f"\x1f\nFile: coreutils.info,  Node: node{i}\n\n" + "Some prose. " * 60
           for i in range(20)]
  text = "".join(nodes).replace("prose.", "pro\0se.", 2)
  (tmp_path / "coreutils.info.gz").write_bytes(gzip.compress(text.encode()))
  assert list(corpus.read_source_files("repo-docs", str(tmp_path))) == [text]


@pytest.mark.parametrize("line, shown", [
    ('{"text": null}', "null"), ('{"text": 42}', "42"),
    ('{"text": {"nested": "dict"}}', '{"nested": "dict"}'),
    ('{"question": "q", "answer": ["a", "list"]}', '["a", "list"]'),
])
def test_a_jsonl_field_that_is_not_a_string_is_named(tmp_path, line, shown):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "ok"}\n' + line + "\n")
  field = "answer" if "answer" in line else "text"
  with pytest.raises(corpus.SourceError, match=re.escape(
      f"source 'hermes3-general': {path}:2: the '{field}' field is {shown}, not a string")):
    list(corpus.read_source_files("hermes3-general", str(path)))


def test_a_few_invalid_bytes_do_not_make_a_file_binary(tmp_path):
  text = "Latin-1 slipped in once: caf\xe9. " + "The rest is plain ASCII prose. " * 40
  (tmp_path / "a.txt").write_bytes(text.encode("latin-1"))
  assert list(corpus.read_source_files("gutenberg", str(tmp_path))) == [
      text.replace("\xe9", "\ufffd")]


def test_a_source_of_only_binary_files_is_an_error_naming_them(tmp_path, capsys):
  for name in ("a.bin", "b.bin"):
    (tmp_path / name).write_bytes(b"\x00\x01\x02")
  with pytest.raises(corpus.SourceError, match=r"source 'repo-docs': no usable text in .*; "
                     r"skipped .*a.bin \(binary \(.* of them NUL\)\), .*b.bin"):
    corpus.load_corpus({"repo-docs": str(tmp_path)}, 1 << 20)
  assert capsys.readouterr().out.count("warning: source 'repo-docs': skipping") == 2


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


def test_the_byte_cap_cuts_the_last_document_at_a_whole_character(tmp_path):
  (tmp_path / "a.txt").write_text("a" * 1000)
  (tmp_path / "b.txt").write_text("é" * 1000)  # two bytes each
  texts = corpus.load_corpus({"gutenberg": str(tmp_path)}, 1501)
  assert texts["gutenberg"] == ["a" * 1000, "é" * 250]  # 500 of the 501 bytes left


# --- Held-out text and prompts ------------------------------------------------------


def test_the_last_share_of_a_source_is_held_out_at_a_word_boundary():
  docs = ["first document " * 10, "second document " * 10, "third one " * 3]
  train, held_out = corpus.split_held_out(docs, share=0.2)
  assert "".join(train) + "".join(held_out) == "".join(docs)  # nothing lost or repeated
  total = sum(len(d) for d in docs)
  assert held_out[-1] == "third one " * 3  # whole documents first, from the end
  assert int(0.2 * total) <= sum(len(d) for d in held_out) < int(0.2 * total) + len("document ")
  assert held_out[0].startswith("document ") and train[-1].endswith(" ")


def test_one_long_document_is_cut_in_two():
  book = " ".join(f"word{i}" for i in range(1000))
  train, held_out = corpus.split_held_out([book])
  assert len(train) == len(held_out) == 1 and train[0] + held_out[0] == book
  assert held_out[0].startswith("word")


def test_prompts_take_turns_over_the_sources_from_their_held_out_text():
  held_out = {"repo-docs": ["...cut mid-document", "## Install\n\npip install it\n" * 3],
              "gutenberg": ["It was a dark and stormy night; the rain fell in torrents. " * 3],
              "hermes3-general": ["Question: Why?\nAnswer: Because of spikes." * 2]}
  prompts = corpus.held_out_prompts(held_out, 4)
  assert [p[:12] for p in prompts[:3]] == ["## Install\n\n", "It was a dar", "Question: Wh"]
  assert prompts[1] == "It was a dark and stormy night; the rain fell in torrents. It "
  assert prompts[3] == "...cut "  # the fourth: repo-docs again; at most half a document
  for prompt in prompts:
    assert len(prompt) <= corpus.PROMPT_CHARS


# --- The default corpus -------------------------------------------------------------

# v1's files and the text they decode to, held here: the same on every machine and Python.
DEFAULT_FILES_SHA256 = {
    "repo-docs": "4e13b517a8a1cf87b292fb79037c93e87286aa089cb1e8dff573e27082dc587e",
    "gutenberg": "629fafa606c55bfd7fd5ad4dfa5fe78fa3b1a8aa21d4a5239341657ea5364544",
    "hermes3-general": "02ac62a537ae5a2ce127ab15c8d5c82562421198daebd7c9c9cc52d23454dde4",
}
DEFAULT_TEXT_SHA256 = "94d84a9a3b25b2a26e9df28bec9ec5f2ca714be0e2bd4093ec116a6aeeb71b4c"
DEFAULT_DOCUMENTS = {"repo-docs": 60, "gutenberg": 98, "hermes3-general": 3548}
LICENCES = ("Apache-2.0", "MIT", "BSD", "PSF-2.0")


def test_the_default_corpus_is_v1_byte_for_byte():
  assert default_corpus.VERSION == "v1"
  for name, want in DEFAULT_FILES_SHA256.items():
    with open(default_corpus.source_path(name), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == want, name
  texts = corpus.load_corpus({}, 1 << 30)
  assert {name: len(docs) for name, docs in texts.items()} == DEFAULT_DOCUMENTS
  digest = hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()
  assert digest == DEFAULT_TEXT_SHA256


def test_the_default_corpus_has_three_forms_and_names_each_origin():
  texts = corpus.load_corpus({}, 1 << 30)
  for name, docs in texts.items():
    assert 400_000 < sum(len(d.encode()) for d in docs) < 560_000, name
  qa = texts["hermes3-general"]
  assert all(re.fullmatch(r"Question: What (does `[\w.]+` do|is `[\w.]+`)\?\nAnswer: .{40,}", d,
                          re.S) for d in qa)
  assert qa[0] == ("Question: What does `abc.abstractmethod` do?\n"
                   "Answer: A decorator indicating abstract methods.")
  assert sum(d.count("\n- ") + d.count("\n* ") for d in texts["repo-docs"]) > 500  # lists
  assert min(len(d) for d in texts["gutenberg"]) >= 200  # whole documents of prose
  for name in corpus.SOURCE_NAMES:
    with lzma.open(default_corpus.source_path(name), "rt", encoding="utf-8") as f:
      origins = [json.loads(line)["origin"] for line in f]
    assert all(origin.endswith(LICENCES) for origin in origins), name
  assert not any("clipjax" in o for o in origins)


def test_a_changed_default_corpus_file_is_refused_by_name(tmp_path, monkeypatch):
  for name in corpus.SOURCE_NAMES:
    shutil.copy(default_corpus.source_path(name), tmp_path)
  changed = tmp_path / "gutenberg.jsonl.xz"
  changed.write_bytes(changed.read_bytes() + b"\0")
  monkeypatch.setattr(default_corpus, "DIRECTORY", str(tmp_path))
  with pytest.raises(corpus.SourceError, match=f"source 'gutenberg': the default corpus file "
                     f"{changed} has SHA-256 [0-9a-f]{{64}}, not v1's 629faf"):
    corpus.load_corpus({}, 1 << 20)
  changed.unlink()
  with pytest.raises(corpus.SourceError, match=f"{changed} cannot be read"):
    corpus.load_corpus({}, 1 << 20)


def test_the_byte_cap_takes_the_first_documents_of_the_default_corpus():
  whole = corpus.load_corpus({}, 1 << 30)
  capped = corpus.load_corpus({}, 50_000)
  for name, docs in capped.items():
    assert sum(len(d.encode()) for d in docs) <= 50_000
    assert docs[:-1] == whole[name][:len(docs) - 1]
    assert whole[name][len(docs) - 1].startswith(docs[-1])  # the last one cut, not changed


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
