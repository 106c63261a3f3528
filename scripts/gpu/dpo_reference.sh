#!/usr/bin/env bash
# Where torch, transformers and peft are installed (the GPU host; no GPU needed), from the
# repository root: regenerate the DPO reference into ${OUT:-out}/dpo_ref.tar.gz (unpack into
# testdata/: tar -C testdata -xzf dpo_ref.tar.gz), which tests/dpo/test_hf_dpo.cpp compares spindle
# with.
set -euo pipefail
work=$(mktemp -d)
PYTHONUNBUFFERED=1 python3 scripts/gpu/dpo_reference.py "$work/dpo"
rm -f "$work/dpo/adapter/README.md"  # PEFT's model-card stub
mkdir -p "${OUT:-out}"
tar -C "$work" -czf "${OUT:-out}/dpo_ref.tar.gz" dpo
ls -la "$work/dpo" "$work/dpo/adapter"
