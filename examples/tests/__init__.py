"""The example's tests: a package, so that their conftest is not taken for tests/conftest.py."""
