#!/usr/bin/env bash
# Where torch, transformers and peft are installed (the GPU host; no GPU needed), from the
# repository root: regenerate the tests' HF references into ${OUT:-out}/hf_refs.tar.gz; unpack it
# into testdata/ (tar -C testdata -xzf hf_refs.tar.gz) on the development machine.
set -euo pipefail
work=$(mktemp -d)
PYTHONUNBUFFERED=1 python3 scripts/gpu/make_hf_refs.py "$work/hf"
python3 -c "import transformers, peft, torch; print('transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
mkdir -p "${OUT:-out}"
tar -C "$work" -czf "${OUT:-out}/hf_refs.tar.gz" hf
ls -la "$work/hf"/*
