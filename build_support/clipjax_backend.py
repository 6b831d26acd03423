"""The build backend: scikit-build-core's, with what build_support/clipjax_build.py decides.

- A wheel's build needs nanobind, the FFI headers of the oldest jaxlib clipjax supports,
  and a CUDA compiler where the machine has none; a source distribution needs none of
  them, so they are asked for here rather than in pyproject.toml's `requires`.
- A wheel carries its variant as its build tag (`clipjax-0.2.0-13cuda-...whl`), unless the
  caller sets one (`--config-settings=wheel.build-tag=...`).
- Where no compiler can be had, the build stops with one line saying what to do.
"""

from __future__ import annotations

import sys

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (the hooks passed on unchanged)
    build_sdist, get_requires_for_build_sdist)

import clipjax_build

# XLA accepts a handler built against an FFI API no newer than its own, so the module is
# built against the oldest jaxlib clipjax supports (FFI API 0.1) and runs on every jaxlib
# that the dependencies allow.
WHEEL_REQUIRES = ["nanobind>=2.4,<3", "jax>=0.7.2,<0.8", "jaxlib>=0.7.2,<0.8"]


def _requires(skbuild_requires: list[str]) -> list[str]:
  try:
    compiler = clipjax_build.compiler_requirements()
  except clipjax_build.NoCompiler as e:
    print(e, file=sys.stderr)
    raise SystemExit(1) from None
  return [*skbuild_requires, *WHEEL_REQUIRES, *compiler]


def _tagged(config_settings: dict | None) -> dict:
  settings = dict(config_settings or {})
  settings.setdefault("wheel.build-tag", clipjax_build.build_tag(clipjax_build.variant()))
  return settings


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
  return _requires(_skbuild.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None) -> list[str]:
  return _requires(_skbuild.get_requires_for_build_editable(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
  return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, _tagged(config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
  return _skbuild.prepare_metadata_for_build_editable(metadata_directory,
                                                      _tagged(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
  return _skbuild.build_wheel(wheel_directory, _tagged(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
  return _skbuild.build_editable(wheel_directory, _tagged(config_settings), metadata_directory)
