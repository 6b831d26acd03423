"""The default text of the three sources: a fixed, versioned corpus shipped with the
example (examples/data/VERSION/), the same bytes on every machine and every Python.

  repo-docs        list-structured docs: the READMEs, .md and .rst files of Python
                   packages under permissive licences (Apache-2.0, MIT, BSD, PSF-2.0)
  gutenberg        long prose: the Python Language Reference's topics (pydoc_data), then
                   long module docstrings of the standard library (CPython 3.11.7, PSF-2.0)
  hermes3-general  question & answer: "What does `json.dumps` do?" -> the first paragraph
                   of its docstring, for the standard library's public functions, classes
                   and methods (CPython 3.11.7, PSF-2.0)

Each is an xz-compressed JSONL file, read like a user's `--source` file, each record
naming its origin; data/README.md says where the text comes from and under which
licence, and data/make_default_corpus.py how it was made. The files are checked against
their SHA-256 before they are read.
"""

import hashlib
import os

VERSION = "v1"
# The files live in examples/data/, beside the package.
EXAMPLES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIRECTORY = os.path.join(EXAMPLES, "data", VERSION)
SHA256 = {
    "repo-docs": "4e13b517a8a1cf87b292fb79037c93e87286aa089cb1e8dff573e27082dc587e",
    "gutenberg": "629fafa606c55bfd7fd5ad4dfa5fe78fa3b1a8aa21d4a5239341657ea5364544",
    "hermes3-general": "02ac62a537ae5a2ce127ab15c8d5c82562421198daebd7c9c9cc52d23454dde4",
}


class DefaultCorpusError(ValueError):
  """A default corpus file that is missing or not the one this version ships."""


def source_path(name: str) -> str:
  """The default corpus file of source `name`, checked against its SHA-256."""
  path = os.path.join(DIRECTORY, f"{name}.jsonl.xz")
  try:
    with open(path, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
  except OSError as e:
    raise DefaultCorpusError(f"the default corpus file {path} cannot be read "
                             f"({e.strerror}); restore it from the repository") from None
  if digest != SHA256[name]:
    raise DefaultCorpusError(
        f"the default corpus file {path} has SHA-256 {digest}, not {VERSION}'s "
        f"{SHA256[name]}; restore it from the repository (`git checkout -- {path}`)")
  return path
