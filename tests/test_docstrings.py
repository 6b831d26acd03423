"""The docstrings are the API reference: every public name has its sections, and the
Examples in them run here, on the CPU, as the reference shows them (doctest)."""

import doctest
import inspect
import io

import pytest

import clipjax


def docstring(name):
  return inspect.getdoc(getattr(clipjax, name)) or ""


@pytest.mark.parametrize("name", clipjax.__all__)
def test_every_public_name_has_a_summary_and_its_sections(name):
  obj = getattr(clipjax, name)
  lines = docstring(name).splitlines()
  assert lines and lines[0].endswith(".") and (len(lines) == 1 or lines[1] == ""), \
      f"clipjax.{name}: the first line is not a one-line summary"
  sections = {line.strip() for line in lines if line.strip().endswith(":")}
  wanted = {"Examples:"}
  if inspect.isclass(obj):
    wanted.add("Args:" if "__post_init__" in vars(obj) else "Attributes:")
  else:
    wanted.add("Returns:")
    if inspect.signature(obj).parameters:
      wanted |= {"Args:", "Raises:"}
  assert wanted <= sections, f"clipjax.{name} lacks {sorted(wanted - sections)}"


@pytest.mark.parametrize("name", clipjax.__all__)
def test_the_examples_of_every_public_name_run(name):
  # Only the name's own docstring, with nothing imported beforehand: an example imports
  # what it uses, as a reader copying it would.
  [test] = doctest.DocTestFinder(recurse=False).find(getattr(clipjax, name), f"clipjax.{name}",
                                                      globs={})
  assert test.examples, f"clipjax.{name} has no Examples"
  out = io.StringIO()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  result = runner.run(test, out=out.write)
  assert result.failed == 0, out.getvalue()
