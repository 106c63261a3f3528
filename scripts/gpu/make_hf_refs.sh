#!/usr/bin/env bash
# On the GPU host: regenerate tests' HF references into $OUT/hf_refs.tar.gz (unpack into testdata/hf).
set -euo pipefail
work=$(mktemp -d)
PYTHONUNBUFFERED=1 python3 scripts/gpu/make_hf_refs.py "$work/hf"
python3 -c "import transformers, peft, torch; print('transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
tar -C "$work" -czf "${OUT:-.}/hf_refs.tar.gz" hf
ls -la "$work/hf"/*
