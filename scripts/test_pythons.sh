#!/usr/bin/env bash
# `make test-pythons`: the native reader and the paths a user meets first
# (reader, convert, parity with mlx_lm, CLI, float16-held weights, the native kernels'
# thread pool) under every
# other CPython we claim, each in its own venv (.venv-py3.X) with the package
# installed editable. The main suite (`make test`) runs on $(PYTHON), 3.11 here.
#
# Why: the native reader freed memory with PyMem_Free while the GIL was
# released; 3.11 tolerated it, 3.12 and 3.13 crash. Only running them sees that.
#
# usage: scripts/test_pythons.sh 3.10 3.12 3.13
# Each version is looked up as pythonX.Y on PATH, then in pyenv's versions
# (newest patch). A version not installed is skipped with a line saying so; if
# none of the asked versions is installed the run fails (nothing was tested).
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=(tests/test_reader.py tests/test_convert.py tests/test_parity.py tests/test_cli.py
       tests/test_half.py tests/test_kernels.py)
# Left to the main suite (CI stays under its 20 minutes; ~45 s a Python):
# - the kernels' numerics are C's, whatever the Python: one case of each parametrized numerics
#   test exercises their use of the C API (refcounts, the GIL, buffers);
# - process behaviour, not the Python's: a killed convert resumed, the converter's memory bound,
#   the Hub's offline error, --device and benchmark paper's device check;
# - families' numerics against transformers (a torch process each, ~8 s): Phi-3 / Granite and the
#   sliding windows (their parity with mlx_lm stays).
DESELECT="not (test_packed_rows_equal_dequantized_rows and not options0) and \
not (test_flash_decode_on_the_active_rows_equals_the_masked_window and not options0) and \
not test_killed_convert_leaves_no_folder_and_rerun_resumes and \
not test_converter_memory_is_bounded_by_a_layer_not_the_model and not test_hub_repo_id_offline and \
not test_device_flag and not test_benchmark_paper_devices_are_checked_first and \
not test_phi3_and_granite_match_transformers and not test_a_sliding_window_is_kept_as_transformers_keeps_it"
PYENV_VERSIONS="$( (command -v pyenv >/dev/null && pyenv root) || echo "$HOME/.pyenv")/versions"

find_python() {  # the first candidate that runs and is that version (pyenv shims may not)
  local v=$1 p
  for p in $(command -v "python$v" 2>/dev/null) \
           $(ls -d "$PYENV_VERSIONS/$v".*/bin/python 2>/dev/null | sort -rV); do
    if "$p" -c "import sys; assert sys.version.startswith('$v.')" >/dev/null 2>&1; then
      echo "$p"
      return 0
    fi
  done
}

tested=()
skipped=()
for v in "$@"; do
  py=$(find_python "$v")
  if [ -z "$py" ]; then
    echo "test-pythons: Python $v is not installed here (PATH or $PYENV_VERSIONS): skipped"
    skipped+=("$v")
    continue
  fi
  venv=".venv-py$v"
  echo "test-pythons: Python $v ($py) in $venv"
  if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] ||
     [ setup.py -nt "$venv/.installed" ] || [ mlx_flash/io/_native.c -nt "$venv/.installed" ]; then
    rm -rf "$venv"
    "$py" -m venv "$venv"
    # (this machine's pip config names local indexes that may be absent: keep their warnings out)
    "$venv/bin/pip" install -q --upgrade pip 2> >(grep -v "^WARNING: Location" >&2)
    "$venv/bin/pip" install -q -e ".[test]" 2> >(grep -v "^WARNING: Location" >&2)
    touch "$venv/.installed"
  fi
  # the extension is optional at install time; here it must have built
  "$venv/bin/python" -c "import mlx_flash.io as io, sys; \
assert io.native_available(), 'the native reader did not build for Python ' + sys.version"
  "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider -k "$DESELECT" "${TESTS[@]}"
  tested+=("$v")
done

if [ ${#tested[@]} -eq 0 ]; then
  echo "test-pythons: none of the Pythons asked for ($*) is installed: nothing was tested" >&2
  exit 1
fi
echo "test-pythons: passed on Python ${tested[*]}${skipped:+ (not installed: ${skipped[*]})}"
