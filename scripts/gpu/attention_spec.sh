#!/usr/bin/env bash
# Runs on the GPU host (one GPU), from the repository root, with the bundle of scripts/gpu/stage.sh
# (BUNDLE_DIR, default build-bundle; STAGE_TARGETS="spindle test_cuda_ops test_cuda_model"): the
# checks of the per-layer attention spec (backend/attention_rule.h) on CUDA, and the transformers
# references of the wave-2 cases on the host's CPU.
#   1. the attention op tests (every kernel against the CPU reference, sliding windows included) and
#      the whole-model CUDA tests;
#   2. spindle bench, Qwen2.5-1.5B LoRA r16 at 32k with keep-attention: the step time of the kernels
#      with the window in their visibility test, against the rows of docs/perf.md on the same GPU kind;
#   3. scripts/gpu/make_hf_refs.py --only CASES (default: the mistral and YaRN cases; CASES=none
#      skips it), packed into ${OUT:-out}/hf_refs.tar.gz (tar -C testdata -xzf it on the development
#      machine). make_hf_refs.py needs no GPU: any machine with torch, transformers and peft makes
#      the same references.
# Writes ${OUT:-out}/attention_spec_{ops,model,bench}.txt.
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
out=${OUT:-$root/out}; mkdir -p "$out"
export SPINDLE_SOURCE_DIR=$root
for f in "$stage"/lib/*; do n=$(basename "$f"); ldconfig -p | grep -q "^[[:space:]]*$n " && rm -f "$f"; done
export LD_LIBRARY_PATH="$stage/lib:/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for pkg in nccl cudnn; do
  if ! ldconfig -p | grep -q "lib$pkg.so"; then
    dir="$(python3 -c "import nvidia.$pkg, os; print(os.path.join(list(nvidia.$pkg.__path__)[0], 'lib'))" 2>/dev/null)"
    [[ -d "$dir" ]] && export LD_LIBRARY_PATH="$dir:$LD_LIBRARY_PATH"
  fi
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$stage/bin/test_cuda_ops" --gtest_filter='*Attention*' > "$out/attention_spec_ops.txt" 2>&1
echo "attention op tests: exit $? ($(grep -c '^\[       OK' "$out/attention_spec_ops.txt") ok, $(grep -c '^\[  FAILED' "$out/attention_spec_ops.txt") failed lines)"
"$stage/bin/test_cuda_model" > "$out/attention_spec_model.txt" 2>&1
echo "model tests: exit $? ($(grep -E '^\[  PASSED|^\[  FAILED' "$out/attention_spec_model.txt" | head -3 | tr '\n' ' '))"
timeout 300 "$stage/bin/spindle" bench --device cuda --model configs/qwen2.5-1.5b.json --seq 32k --lora-rank 16 \
  --recompute keep-attention --warmup 1 --steps 3 --profile-steps 0 > "$out/attention_spec_bench.txt" 2>&1
tail -4 "$out/attention_spec_bench.txt"
[[ "${CASES:-}" == none ]] && exit 0
work=$(mktemp -d)
PYTHONUNBUFFERED=1 python3 scripts/gpu/make_hf_refs.py "$work/hf" --only "${CASES:-mistral,mistral_lora,qwen3_yarn,llama_yarn}" \
  > "$out/hf_refs.txt" 2>&1 || { echo "make_hf_refs failed:"; tail -20 "$out/hf_refs.txt"; }
tail -6 "$out/hf_refs.txt"
tar -C "$work" -czf "$out/hf_refs.tar.gz" hf
