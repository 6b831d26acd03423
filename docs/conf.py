"""Sphinx configuration: MyST Markdown pages, the API from docstrings, results from records."""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, DOCS)

import make_results  # noqa: E402  (docs/make_results.py, beside this file)

import clipjax  # noqa: E402

project = "clipjax"
author = "The clipjax authors"
copyright = "The clipjax authors"
release = clipjax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}  # autosummary writes .rst stubs
root_doc = "index"
# The generated tables are included into pages, not pages of their own; the records are data.
exclude_patterns = ["_build", "_generated", "results", "README.md"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "clipjax"

# The tables and figures the pages include are made from docs/results/ at every build.
make_results.main()
