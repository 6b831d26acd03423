"""The three text sources the bandit mixes, as lists of documents.

Each source has a distinct form, as in the ANDREA documents:

  repo-docs        list-structured documentation
  gutenberg        long prose
  hermes3-general  question & answer

A source comes from the user's files (`--source NAME=PATH_OR_GLOB`: plain text, one
document per file, or JSONL with `question`/`answer` fields or a `text` field), or, by
default, from real text already on any machine where Python is installed, so the example
needs no download and the repository ships no data:

  repo-docs        the README (METADATA body), .md and .rst files of installed packages
  gutenberg        the long reference texts in `pydoc_data.topics` and long stdlib module
                   docstrings
  hermes3-general  "What does `json.dumps` do?" -> the first paragraph of its docstring,
                   for public functions, classes and methods of the stdlib (read with
                   `ast`, nothing is imported)

File lists are sorted, so the default corpus is the same on every run on one machine.
"""

import ast
import functools
import glob
import json
import os
import pydoc_data.topics
import site
import sysconfig
import warnings
from typing import Iterable, Iterator, Sequence

SOURCE_NAMES = ("repo-docs", "gutenberg", "hermes3-general")

_SKIPPED_DIRS = frozenset(
    {"__pycache__", "test", "tests", "testing", "idle_test", "site-packages",
     "idlelib", "lib2to3", "turtledemo", "ensurepip", "licenses", "node_modules"})
_SKIPPED_FILE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")
_MIN_DOC_CHARS = 200
_MIN_MODULE_DOC_CHARS = 1500
_MIN_ANSWER_CHARS = 40


class SourceError(ValueError):
  """A --source flag or a source file that cannot be used; the message names it."""


def format_qa(question: str, answer: str) -> str:
  return f"Question: {question.strip()}\nAnswer: {answer.strip()}"


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


def load_corpus(source_paths: dict[str, str], max_bytes: int) -> dict[str, list[str]]:
  """All three sources: the user's files where given, else the default text."""
  defaults = {
      "repo-docs": default_repo_docs,
      "gutenberg": default_gutenberg,
      "hermes3-general": default_hermes3_general,
  }
  corpus = {}
  for name in SOURCE_NAMES:
    if name in source_paths:
      docs = read_source_files(name, source_paths[name])
    else:
      docs = defaults[name]()
    corpus[name] = _take(docs, max_bytes)
    if not corpus[name]:
      raise SourceError(f"source {name!r}: no text found")
  return corpus


# --- The user's files -------------------------------------------------------------


def read_source_files(name: str, pattern: str) -> Iterator[str]:
  """Documents from a file, a directory (all files below it) or a glob."""
  pattern = os.path.expanduser(pattern)
  if os.path.isdir(pattern):
    pattern = os.path.join(pattern, "**", "*")
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise SourceError(f"source {name!r}: no file matches {pattern!r}")
  for path in paths:
    if os.path.getsize(path) == 0:
      raise SourceError(f"source {name!r}: file {path} is empty")
    if path.endswith(".jsonl"):
      yield from _read_jsonl(name, path)
    else:
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
      if not text.strip():
        raise SourceError(f"source {name!r}: file {path} is empty")
      yield text


def _read_jsonl(name: str, path: str) -> Iterator[str]:
  found = False
  with open(path, encoding="utf-8", errors="replace") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"source {name!r}: {path}:{line_number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise SourceError(f"{where}: not valid JSON ({e.msg})") from None
      if isinstance(record, dict) and "question" in record and "answer" in record:
        yield format_qa(str(record["question"]), str(record["answer"]))
      elif isinstance(record, dict) and "text" in record:
        yield str(record["text"])
      else:
        raise SourceError(
            f"{where}: expected an object with 'question' and 'answer' fields "
            "(or a 'text' field)")
      found = True
  if not found:
    raise SourceError(f"source {name!r}: file {path} is empty")


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


# --- The default corpus, from the installed Python --------------------------------


def _walk_sorted(root: str) -> Iterator[str]:
  for directory, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
    for filename in sorted(filenames):
      yield os.path.join(directory, filename)


def _site_packages_dirs() -> list[str]:
  dirs = set(site.getsitepackages())
  dirs.update(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
  if site.ENABLE_USER_SITE:
    dirs.add(site.getusersitepackages())
  return sorted(d for d in dirs if os.path.isdir(d))


def default_repo_docs() -> Iterator[str]:
  for root in _site_packages_dirs():
    for path in _walk_sorted(root):
      filename = os.path.basename(path)
      is_metadata = filename == "METADATA" and path.endswith(".dist-info/METADATA")
      if filename.upper().startswith(_SKIPPED_FILE_PREFIXES):
        continue
      if not (is_metadata or filename.endswith((".md", ".rst"))):
        continue
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
      if is_metadata:  # the headers end at the first blank line; the body is the README
        text = text.partition("\n\n")[2]
      if len(text.strip()) >= _MIN_DOC_CHARS:
        yield text.strip()


def default_gutenberg() -> Iterator[str]:
  for _, text in sorted(pydoc_data.topics.topics.items()):
    if len(text) >= _MIN_DOC_CHARS:
      yield text.strip()
  module_docs, _ = _parsed_stdlib()
  yield from (doc for doc in module_docs if len(doc) >= _MIN_MODULE_DOC_CHARS)


def default_hermes3_general() -> Iterator[str]:
  _, definitions = _parsed_stdlib()
  for qualname, docstring, is_class in definitions:
    answer = " ".join(docstring.split("\n\n")[0].split())
    if len(answer) < _MIN_ANSWER_CHARS:
      continue
    question = (f"What is `{qualname}`?" if is_class else f"What does `{qualname}` do?")
    yield format_qa(question, answer)


@functools.lru_cache(maxsize=1)
def _parsed_stdlib() -> tuple[list[str], list[tuple[str, str, bool]]]:
  """Module docstrings, and (qualified name, docstring, is_class) of the public
  functions, classes and methods, of every public stdlib module."""
  stdlib = sysconfig.get_paths()["stdlib"]
  module_docs, definitions = [], []
  for path in _walk_sorted(stdlib):
    module = _module_name(stdlib, path)
    if module is None:
      continue
    try:
      with open(path, encoding="utf-8") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    doc = ast.get_docstring(tree)
    if doc:
      module_docs.append(doc)
    definitions.extend(_public_definitions(tree, module))
  return module_docs, definitions


def _module_name(stdlib: str, path: str) -> str | None:
  if not path.endswith(".py"):
    return None
  parts = os.path.relpath(path, stdlib)[:-len(".py")].split(os.sep)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  if not parts or any(p.startswith("_") for p in parts):
    return None
  return ".".join(parts)


def _public_definitions(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, bool]]:
  for child in getattr(node, "body", []):
    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    if child.name.startswith("_"):
      continue
    qualname = f"{prefix}.{child.name}"
    doc = ast.get_docstring(child)
    is_class = isinstance(child, ast.ClassDef)
    if doc:
      yield qualname, doc, is_class
    if is_class:
      yield from _public_definitions(child, qualname)
