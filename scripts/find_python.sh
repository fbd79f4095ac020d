#!/usr/bin/env bash
# Print the path of a Python >= 3.12 that can make a venv: $PYTHON if set, else the first that
# runs of python3.X and pyenv's installed 3.X.* for each X given (in that order), then python3.
# Each candidate is run, not looked up: pyenv's shims are on PATH for every version it has, but
# fail unless that version is selected.   Usage: find_python.sh 3.13 3.12
usable() {
  "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 \
    && "$1" -c 'import sys; print(sys.executable)'
}
if [ -n "${PYTHON:-}" ]; then
  usable "$PYTHON" && exit 0
  echo "PYTHON=$PYTHON is not a Python >= 3.12 with venv and ensurepip" >&2
  exit 1
fi
root=$(pyenv root 2>/dev/null)
for v in "$@"; do
  for c in "python$v" $(ls -d "$root/versions/$v".*/bin/python3 2>/dev/null | sort -rV); do
    usable "$c" && exit 0
  done
done
usable python3 && exit 0
echo "no Python >= 3.12 found (tried $(printf 'python%s, ' "$@")pyenv's versions, python3):" \
  "install one, or name it: make PYTHON=/path/to/python3.12 ..." >&2
exit 1
