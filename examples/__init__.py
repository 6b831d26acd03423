"""The example, importable as a package only so that its tests have names of their own."""
