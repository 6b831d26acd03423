"""The version of clipjax, in one place (the build reads the VERSION line), and the variant
of this install: `__version__` is e.g. "0.2.0+cu13" for a build holding the CUDA custom
call built with CUDA 13, "0.2.0+cpu" for one without it, and VERSION alone where clipjax is
imported from a source tree that pip never built."""

VERSION = "0.2.0"


def _variant() -> str:
  try:  # written by the build (CMakeLists.txt), from build_support/clipjax_build.py
    from clipjax._variant import VARIANT
  except ImportError:
    return ""
  return "+" + VARIANT


__version__ = VERSION + _variant()
