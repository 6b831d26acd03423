"""The three text sources the bandit mixes: the user's files or the default text, each
split into training text and held-out text, and the sample prompts drawn from the latter.

Each source has a distinct form, as in the ANDREA documents:

  repo-docs        list-structured documentation
  gutenberg        long prose
  hermes3-general  question & answer

`--source NAME=PATH_OR_GLOB` reads a source from the user's files (a file, a directory,
meaning every file below it, or a glob; read in sorted order). Each file is

- decompressed first if its name ends in .gz, .bz2 or .xz;
- skipped, with one warning line naming it, if it is binary (more than MAX_BINARY_SHARE
  of its bytes are control bytes other than whitespace, NUL among them, or are not UTF-8),
  holds no text, or does not decompress; text with a few such bytes (odd NULs) is kept,
  and a GNU info file's separators (INFO_SEPARATORS) count as text, so that the index
  file of a split manual, made of little else, is read like its other files;
- JSONL if its first non-blank line is a JSON object, whatever the file is called: one
  document per line, from `question` and `answer` fields or a `text` field, each a string
  (any other line stops the run, naming the file and line);
- otherwise one plain-text document.

A source whose files are all skipped is an error naming the source and every file. Sources
not named on the command line read the default corpus's file of the same form
(default_corpus.py), in the same way.

The last HELD_OUT_SHARE of each source's text (by characters) is held out of training;
the samples at the end of a run continue prompts cut from it.
"""

import bz2
import glob
import gzip
import json
import lzma
import os
import re
from typing import Callable, Iterable, Iterator, Sequence

from . import default_corpus

SOURCE_NAMES = ("repo-docs", "gutenberg", "hermes3-general")
MAX_BINARY_SHARE = 0.01
# C0 control bytes and DEL, less the whitespace that text uses (tab, LF, VT, FF, CR).
_CONTROL_BYTES = bytes(b for b in [*range(32), 127] if b not in b"\t\n\v\f\r")
# GNU info's separators: 0x1f alone on a line before each node and table ("\x1f\nFile:",
# "\x1f\nTag Table:"), and 0x7f between a node and its offset in a tag table ("Node:
# Top\x7f1234"). In an image, archive or library they are two of many control bytes.
INFO_SEPARATORS = re.compile(rb"\x1f(?=\f?\r?\n)|\x7f(?=\d+\r?\n)")
HELD_OUT_SHARE = 0.05
PROMPT_CHARS = 64
_DECOMPRESS = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
_DECOMPRESS_ERRORS = (OSError, EOFError, ValueError, lzma.LZMAError)


class SourceError(ValueError):
  """A --source flag or a source file that cannot be used; the message names it."""


def parse_source_flags(flags: Sequence[str]) -> dict[str, str]:
  """["gutenberg=books/*.txt", ...] -> {"gutenberg": "books/*.txt"}."""
  paths = {}
  for flag in flags:
    name, sep, path = flag.partition("=")
    if not sep or not path:
      raise SourceError(f"--source {flag!r}: expected NAME=PATH_OR_GLOB")
    if name not in SOURCE_NAMES:
      raise SourceError(
          f"--source {flag!r}: unknown source {name!r}; the sources are "
          f"{', '.join(SOURCE_NAMES)}")
    if name in paths:
      raise SourceError(f"--source {name!r} is given twice")
    paths[name] = path
  return paths


def check_source_flags(flags: Sequence[str]) -> None:
  """The --source flags parse and each names files, before anything is read."""
  for name, pattern in parse_source_flags(flags).items():
    source_files(name, pattern)


def load_corpus(source_paths: dict[str, str], max_bytes: int,
                warn: Callable[[str], None] = print) -> dict[str, list[str]]:
  """All three sources: the user's files where given, else the default text; at most
  max_bytes of UTF-8 each."""
  corpus = {}
  for name in SOURCE_NAMES:
    if name in source_paths:
      docs = read_source_files(name, source_paths[name], warn)
    else:
      try:
        docs = read_source_files(name, default_corpus.source_path(name), warn)
      except default_corpus.DefaultCorpusError as e:
        raise SourceError(f"source {name!r}: {e}") from None
    corpus[name] = _take(docs, max_bytes)
    if not corpus[name]:
      raise SourceError(f"source {name!r}: no text found")
  return corpus


# --- The user's files -------------------------------------------------------------


def read_source_files(name: str, pattern: str,
                      warn: Callable[[str], None] = print) -> Iterator[str]:
  """Documents from a file, a directory (all files below it) or a glob."""
  paths = source_files(name, pattern)
  found, skipped = False, []
  for path in paths:
    text, problem = read_text(path)
    docs = [] if text is None else documents(name, path, text)
    found = found or bool(docs)
    yield from docs
    if not docs:
      problem = problem or "no text"
      warn(f"warning: source {name!r}: skipping {path}: {problem}")
      skipped.append(f"{path} ({problem})")
  if not found:
    raise SourceError(f"source {name!r}: no usable text in {pattern!r}; skipped "
                      + ", ".join(skipped))


def source_files(name: str, pattern: str) -> list[str]:
  """The files of a --source: the file, every file below the directory, or the glob's
  matches, in sorted order; an error naming the source if there are none."""
  pattern = os.path.expanduser(pattern)
  if os.path.isfile(pattern):  # a file is itself, whatever characters its name holds
    return [pattern]
  if os.path.isdir(pattern):
    pattern = os.path.join(glob.escape(pattern), "**", "*")
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise SourceError(f"source {name!r}: no file matches {pattern!r}")
  return paths


def read_text(path: str) -> tuple[str | None, str | None]:
  """(the file's text, None), or (None, why it is not text)."""
  with open(path, "rb") as f:
    data = f.read()
  suffix = os.path.splitext(path)[1].lower()
  if suffix in _DECOMPRESS:
    try:
      data = _DECOMPRESS[suffix](data)
    except _DECOMPRESS_ERRORS as e:
      return None, f"does not decompress as {suffix} ({type(e).__name__}: {e})"
  text_like = INFO_SEPARATORS.sub(b"", data)
  control = len(text_like) - len(text_like.translate(None, _CONTROL_BYTES))
  if control > MAX_BINARY_SHARE * len(data):
    return None, (f"binary ({control / len(data):.1%} of its bytes are control bytes, "
                  f"{data.count(0)} of them NUL)")
  invalid = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
  if invalid > MAX_BINARY_SHARE * len(data):
    return None, f"binary ({invalid / len(data):.0%} of its bytes are not UTF-8)"
  return data.decode("utf-8", errors="replace").removeprefix("\ufeff"), None


def documents(name: str, path: str, text: str) -> list[str]:
  """A JSONL file's records (recognised by its first non-blank line), else the text as
  one document; [] for a file with no text."""
  lines = text.split("\n")
  first = next((line for line in lines if line.strip()), None)
  if first is None:
    return []
  if not _is_json_object(first):
    return [text]
  docs = []
  for line_number, line in enumerate(lines, start=1):
    if line.strip():
      docs.append(_jsonl_document(f"source {name!r}: {path}:{line_number}", line))
  return docs


def _is_json_object(line: str) -> bool:
  try:
    return isinstance(json.loads(line), dict)
  except json.JSONDecodeError:
    return False


def _jsonl_document(where: str, line: str) -> str:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise SourceError(f"{where}: not valid JSON ({e.msg})") from None
  if isinstance(record, dict) and "question" in record and "answer" in record:
    return format_qa(_string(where, record, "question"), _string(where, record, "answer"))
  if isinstance(record, dict) and "text" in record:
    return _string(where, record, "text")
  raise SourceError(f"{where}: expected an object with 'question' and 'answer' fields "
                    "(or a 'text' field)")


def _string(where: str, record: dict, field: str) -> str:
  value = record[field]
  if not isinstance(value, str):
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise SourceError(f"{where}: the {field!r} field is {shown}, not a string")
  return value


def format_qa(question: str, answer: str) -> str:
  return f"Question: {question.strip()}\nAnswer: {answer.strip()}"


def _take(docs: Iterable[str], max_bytes: int) -> list[str]:
  """The first documents, cut so their UTF-8 size adds up to at most max_bytes."""
  taken, size = [], 0
  for doc in docs:
    doc_bytes = len(doc.encode("utf-8"))
    if size + doc_bytes > max_bytes:
      rest = doc.encode("utf-8")[:max_bytes - size].decode("utf-8", errors="ignore")
      if rest.strip():
        taken.append(rest)
      break
    taken.append(doc)
    size += doc_bytes
  return taken


# --- Held-out text and sample prompts ---------------------------------------------


def split_held_out(docs: list[str], share: float = HELD_OUT_SHARE
                   ) -> tuple[list[str], list[str]]:
  """(training documents, held-out documents): the last `share` of the characters is
  held out, the document it starts in cut at a whitespace."""
  train, held_out = list(docs), []
  wanted = int(share * sum(len(doc) for doc in docs))
  while wanted > 0 and train:
    doc = train.pop()
    if len(doc) <= wanted:
      held_out.insert(0, doc)
      wanted -= len(doc)
      continue
    cut = len(doc) - wanted
    cut = max(doc.rfind(" ", 0, cut), doc.rfind("\n", 0, cut)) + 1 or cut
    if doc[:cut].strip():
      train.append(doc[:cut])
    held_out.insert(0, doc[cut:])
    wanted = 0
  return train, held_out


def held_out_prompts(held_out: dict[str, list[str]], count: int) -> list[str]:
  """`count` prompts taking turns over the sources; each is the start of one held-out
  document (the last first: the first may begin mid-document), about PROMPT_CHARS long."""
  names = [name for name in held_out if any(doc.strip() for doc in held_out[name])]
  if not names:
    return []
  prompts = []
  for i in range(count):
    docs = [doc for doc in held_out[names[i % len(names)]] if doc.strip()]
    prompts.append(_prompt(docs[-1 - (i // len(names)) % len(docs)]))
  return prompts


def _prompt(doc: str) -> str:
  """The start of `doc`, at most PROMPT_CHARS and half of it, cut after a whitespace."""
  text = doc.lstrip()
  limit = max(1, min(PROMPT_CHARS, len(text) // 2))
  cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit)) + 1
  return text[:cut or limit]
