#!/usr/bin/env bash
# Prints the path of the first Python VERSION (e.g. 3.12) that runs on this machine: on the
# PATH, in pyenv (a shim may exist for a version that is not active), or uv's, installing
# it with uv where uv can; prints nothing and fails where there is none.
#
#   scripts/find_python.sh 3.12
set -uo pipefail
version=${1:?usage: scripts/find_python.sh VERSION}
runs() {
  [[ -x "$1" ]] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" 2>/dev/null
}
for candidate in "$(command -v "python$version")" \
                 "$(pyenv root 2>/dev/null)"/versions/"$version"*/bin/python"$version" \
                 "$HOME"/.pyenv/versions/"$version"*/bin/python"$version"; do
  if runs "$candidate"; then echo "$candidate"; exit 0; fi
done
if uv --version >/dev/null 2>&1; then
  found=$(uv python find "$version" 2>/dev/null ||
          { uv python install "$version" >/dev/null 2>&1 && uv python find "$version"; })
  if runs "$found"; then echo "$found"; exit 0; fi
fi
exit 1
