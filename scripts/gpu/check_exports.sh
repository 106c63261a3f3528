#!/usr/bin/env bash
# Do transformers and peft load spindle's exports and compute spindle's numbers?
#
# 1. On the build machine, write the cases:
#      SPINDLE_EXPORT_CASES_DIR=$PWD/.exports build/tests/train/test_train --gtest_filter='PythonStackCases.*'
#    (.exports is not tracked; copy it to the GPU host with the repository).
# 2. Where torch, transformers and peft are installed (the GPU host), from the repository root:
#      scripts/gpu/check_exports.sh [.exports]
# Prints a line per case and PASS or FAIL; exit status 0 only on PASS.
set -euo pipefail
cd "$(dirname "$0")/../.."
cases="${1:-.exports}"
if [[ ! -f "$cases/cases.json" ]]; then
  echo "no $cases/cases.json: write the cases first (step 1 in $0)" >&2
  exit 2
fi
PYTHONUNBUFFERED=1 exec python3 scripts/gpu/check_exports.py "$cases" "${@:2}"
