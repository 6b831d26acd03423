"""The version of clipjax, in one place (the build reads it from this file)."""

__version__ = "0.2.0"
