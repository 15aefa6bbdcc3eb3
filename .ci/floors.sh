#!/usr/bin/env bash
# The core tests and the README's Quickstart on the oldest versions
# pyproject.toml accepts: a fresh virtual environment (not seeing this
# interpreter's packages) with each core dependency pinned at its floor.
set -euo pipefail
cd "$(dirname "$0")/.."
# The venv alone decides what imports.
unset PYTHONPATH

# Test files left out, each for the packages beyond the core dependencies
# and the `test` extra that it needs. Every other file in tests/ is a core
# test: a new file runs here by default, and one that needs an extra fails
# loudly until it is listed, instead of silently dropping out.
NOT_CORE=(
  tests/test_checkpoint.py    # orbax-checkpoint
  tests/test_demo.py          # the demo's scikit-learn
  tests/test_docs.py          # sphinx, myst-nb
  tests/test_examples.py      # flax, equinox
  tests/test_flax_program.py  # flax
  tests/test_notebooks.py     # nbclient, ipykernel, matplotlib
  tests/test_optax_compat.py  # optax's own test modules import flax
  tests/test_packaging.py     # build, twine
  tests/test_readme.py        # docs blocks import flax, equinox, sklearn
  tests/test_types.py         # mypy
)

ignores=()
for file in "${NOT_CORE[@]}"; do
  [[ -f $file ]] || { echo "floors.sh: $file is listed but missing" >&2; exit 1; }
  ignores+=("--ignore=$file")
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
python .ci/floor_pins.py > "$work/floors.txt"
echo "floors.sh: core dependencies pinned at their floors:" $(cat "$work/floors.txt")
# scikit-learn: the Quickstart's data set; its version is not what this checks.
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --only-binary :all: --constraint "$work/floors.txt" \
  --editable ".[test]" scikit-learn
"$work/venv/bin/python" -m pip check

"$work/venv/bin/python" -m pytest -p no:cacheprovider \
  "${ignores[@]}"

# The Quickstart: the first python block after "## Quickstart", run as a
# reader would, without the test suite's XLA_FLAGS.
awk '/^## Quickstart/ {q = 1} q && /^```python$/ {p = 1; next} p && /^```$/ {exit} p' \
  README.md > "$work/quickstart.py"
[[ -s $work/quickstart.py ]] || { echo "floors.sh: no Quickstart block in README.md" >&2; exit 1; }
(cd "$work" && env -u XLA_FLAGS venv/bin/python quickstart.py)
echo "floors.sh: passed in ${SECONDS}s"
