"""The default text of the three sources, from the Python installed on this machine.

The example needs no download and the repository ships no data: each source has a
default with the form of its ANDREA counterpart, read from files every Python
installation has.

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
import os
import pydoc_data.topics
import site
import sysconfig
import warnings
from typing import Iterator

_SKIPPED_DIRS = frozenset(
    {"__pycache__", "test", "tests", "testing", "idle_test", "site-packages",
     "idlelib", "lib2to3", "turtledemo", "ensurepip", "licenses", "node_modules"})
_SKIPPED_FILE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")
_MIN_DOC_CHARS = 200
_MIN_MODULE_DOC_CHARS = 1500
_MIN_ANSWER_CHARS = 40


def format_qa(question: str, answer: str) -> str:
  return f"Question: {question.strip()}\nAnswer: {answer.strip()}"


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


def repo_docs() -> Iterator[str]:
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


def gutenberg() -> Iterator[str]:
  for _, text in sorted(pydoc_data.topics.topics.items()):
    if len(text) >= _MIN_DOC_CHARS:
      yield text.strip()
  module_docs, _ = _parsed_stdlib()
  yield from (doc for doc in module_docs if len(doc) >= _MIN_MODULE_DOC_CHARS)


def hermes3_general() -> Iterator[str]:
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


SOURCES = {"repo-docs": repo_docs, "gutenberg": gutenberg, "hermes3-general": hermes3_general}
