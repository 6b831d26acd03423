"""How the default corpus (this directory's *.jsonl.xz) was made; not run by the example.

The example trains on the three files this script wrote once, which ship with it: the
same bytes on every machine and every Python (`gpt/data/default_corpus.py` checks their
SHA-256).
Run again, it reads the Python that runs it, and only CPython 3.11.7 with the packages
named in README.md gives those bytes back. A new corpus gets a new version directory.

  repo-docs        the README (METADATA body), .md and .rst files of the installed
                   packages under permissive licences (LICENCES below), by package
  gutenberg        the reference texts of `pydoc_data.topics` (the Python Language
                   Reference), then long module docstrings of the standard library
  hermes3-general  "What does `json.dumps` do?" -> the first paragraph of its docstring,
                   for public functions, classes and methods of the standard library
                   (read with `ast`, nothing imported)

Each source is whole documents, in sorted order, up to MAX_SOURCE_BYTES of text.

    python examples/data/make_default_corpus.py examples/data/v2   # a new version
"""

import argparse
import ast
import email.parser
import hashlib
import json
import lzma
import os
import pydoc_data.topics
import site
import sys
import sysconfig
import warnings
from typing import Iterator

MAX_SOURCE_BYTES = 512 * 1024
# Licences whose text may ship with the example, as the packages' metadata names them.
LICENCES = {
    "Apache-2.0": ("Apache-2.0", "Apache Software License"),
    "MIT": ("MIT", "MIT License"),
    "BSD": ("BSD-2-Clause", "BSD-3-Clause", "BSD License", "BSD 3-Clause License"),
    "PSF-2.0": ("PSF-2.0", "Python Software Foundation License"),
}
_OWN_PACKAGE = "clipjax"  # its README changes with every release: not a fixed text
_SKIPPED_DIRS = frozenset(
    {"__pycache__", "test", "tests", "testing", "idle_test", "site-packages",
     "idlelib", "lib2to3", "turtledemo", "ensurepip", "licenses", "node_modules"})
_SKIPPED_FILE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")
_MIN_DOC_CHARS = 200
_MIN_MODULE_DOC_CHARS = 1500
_MIN_ANSWER_CHARS = 40
PYTHON = f"CPython {sys.version.split()[0]}"


def _walk_sorted(root: str) -> Iterator[str]:
  for directory, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
    for filename in sorted(filenames):
      yield os.path.join(directory, filename)


def _licence(metadata) -> str | None:
  """The LICENCES key the distribution's metadata names, or None."""
  names = [metadata.get("License-Expression", ""), metadata.get("License", "")]
  names += [c.rsplit("::", 1)[-1].strip() for c in metadata.get_all("Classifier", [])
            if c.startswith("License ::")]
  for key, spellings in LICENCES.items():
    if any(name.strip() in spellings for name in names):
      return key
  return None


def _distributions(site_packages: str) -> Iterator[tuple[str, str, str, list[str], str]]:
  """(name, version, licence, the documents' paths, the dist-info directory) of each
  installed distribution under a LICENCES licence, by name."""
  for entry in sorted(os.listdir(site_packages)):
    if not entry.endswith(".dist-info"):
      continue
    with open(os.path.join(site_packages, entry, "METADATA"), encoding="utf-8") as f:
      metadata = email.parser.Parser().parse(f, headersonly=True)
    name, licence = metadata["Name"], _licence(metadata)
    if licence is None or name == _OWN_PACKAGE:
      continue
    paths = [os.path.join(site_packages, entry, "METADATA")]
    record = os.path.join(site_packages, entry, "RECORD")
    if os.path.exists(record):
      with open(record, encoding="utf-8") as f:
        files = sorted(line.rsplit(",", 2)[0] for line in f)
      paths += [os.path.join(site_packages, p) for p in files
                if p.endswith((".md", ".rst")) and ".dist-info" not in p
                and not os.path.basename(p).upper().startswith(_SKIPPED_FILE_PREFIXES)
                and not set(p.split("/")[:-1]) & _SKIPPED_DIRS]
    yield name, metadata["Version"], licence, paths, os.path.join(site_packages, entry)


def repo_docs() -> Iterator[dict]:
  site_packages = sysconfig.get_paths()["purelib"]
  for name, version, licence, paths, _ in _distributions(site_packages):
    for path in paths:
      if not os.path.isfile(path):
        continue
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
      if path.endswith("METADATA"):  # the headers end at the first blank line
        text, where = text.partition("\n\n")[2], "README (METADATA)"
      else:
        where = os.path.relpath(path, site_packages)
      if len(text.strip()) >= _MIN_DOC_CHARS:
        yield {"text": text.strip(), "origin": f"{name} {version}: {where}; {licence}"}


def gutenberg() -> Iterator[dict]:
  for topic, text in sorted(pydoc_data.topics.topics.items()):
    if len(text) >= _MIN_DOC_CHARS:
      yield {"text": text.strip(),
             "origin": f"{PYTHON}: pydoc_data.topics[{topic!r}]; PSF-2.0"}
  module_docs, _ = _parsed_stdlib()
  for module, doc in module_docs:
    if len(doc) >= _MIN_MODULE_DOC_CHARS:
      yield {"text": doc, "origin": f"{PYTHON}: the docstring of {module}; PSF-2.0"}


def hermes3_general() -> Iterator[dict]:
  _, definitions = _parsed_stdlib()
  for qualname, docstring, is_class in definitions:
    answer = " ".join(docstring.split("\n\n")[0].split())
    if len(answer) >= _MIN_ANSWER_CHARS:
      question = f"What is `{qualname}`?" if is_class else f"What does `{qualname}` do?"
      yield {"question": question, "answer": answer,
             "origin": f"{PYTHON}: the docstring of {qualname}; PSF-2.0"}


def _parsed_stdlib():
  """[(module, docstring)] and [(qualified name, docstring, is_class)] of the public
  functions, classes and methods of every public standard-library module."""
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
    if doc := ast.get_docstring(tree):
      module_docs.append((module, doc))
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


def _public_definitions(node: ast.AST, prefix: str):
  for child in getattr(node, "body", []):
    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    if child.name.startswith("_"):
      continue
    qualname = f"{prefix}.{child.name}"
    is_class = isinstance(child, ast.ClassDef)
    if doc := ast.get_docstring(child):
      yield qualname, doc, is_class
    if is_class:
      yield from _public_definitions(child, qualname)


SOURCES = {"repo-docs": repo_docs, "gutenberg": gutenberg, "hermes3-general": hermes3_general}


def _first_records(records, max_bytes: int) -> list[dict]:
  """Whole records, in order, while their text adds up to at most max_bytes."""
  taken, size = [], 0
  for record in records:
    size += sum(len(v.encode("utf-8")) for k, v in record.items() if k != "origin")
    if size > max_bytes:
      break
    taken.append(record)
  return taken


def write_source(path: str, records: list[dict]) -> str:
  """Writes the records as xz-compressed JSONL; returns the file's SHA-256."""
  lines = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
  data = lzma.compress(lines.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)
  with open(path, "wb") as f:
    f.write(data)
  return hashlib.sha256(data).hexdigest()


def notices(origins: set[str]) -> str:
  """The licence files of CPython and of every distribution in `origins`."""
  parts = []
  with open(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"), encoding="utf-8") as f:
    parts.append((f"{PYTHON}: LICENSE.txt", f.read()))
  for name, version, _, _, dist_info in _distributions(sysconfig.get_paths()["purelib"]):
    if f"{name} {version}" not in origins:
      continue
    for directory, dirnames, filenames in sorted(os.walk(dist_info)):
      for filename in sorted(filenames):
        relative = os.path.relpath(os.path.join(directory, filename), dist_info)
        if filename.upper().startswith(_SKIPPED_FILE_PREFIXES) or \
            relative.startswith("licenses" + os.sep):
          with open(os.path.join(directory, filename), encoding="utf-8", errors="replace") as f:
            parts.append((f"{name} {version}: {relative}", f.read()))
  return "".join(f"{'=' * 78}\n{title}\n{'=' * 78}\n{text.strip()}\n\n" for title, text in parts)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out_dir", help="a new version directory, e.g. examples/data/v2")
  args = p.parse_args(argv)
  if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
    print(f"note: the user's packages in {site.getusersitepackages()} are not read")
  os.makedirs(args.out_dir, exist_ok=True)
  origins = set()
  for name, source in SOURCES.items():
    records = _first_records(source(), MAX_SOURCE_BYTES)
    digest = write_source(os.path.join(args.out_dir, f"{name}.jsonl.xz"), records)
    origins.update(r["origin"].split(":")[0] for r in records)
    print(f'"{name}": "{digest}",  # {len(records)} documents')
  with open(os.path.join(args.out_dir, "NOTICES.txt.xz"), "wb") as f:
    f.write(lzma.compress(notices(origins).encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))


if __name__ == "__main__":
  main()
