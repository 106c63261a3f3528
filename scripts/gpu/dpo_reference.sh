#!/usr/bin/env bash
# On the GPU host: regenerate the DPO reference into $OUT/dpo_ref.tar.gz (unpack into testdata/:
# tar -C testdata -xzf dpo_ref.tar.gz), which tests/dpo/test_hf_dpo.cpp compares spindle with.
set -euo pipefail
work=$(mktemp -d)
PYTHONUNBUFFERED=1 python3 scripts/gpu/dpo_reference.py "$work/dpo"
rm -f "$work/dpo/adapter/README.md"  # PEFT's model-card stub
tar -C "$work" -czf "${OUT:-.}/dpo_ref.tar.gz" dpo
ls -la "$work/dpo" "$work/dpo/adapter"
