#!/usr/bin/env bash
# On the GPU host: one PyTorch SDPA forward+backward forced onto the cuDNN backend (causal, bf16,
# q [1, 12, 4096, 128], k/v 2 heads expanded to 12), with cuDNN's API log and cudnn-frontend's
# graph log, so that the op graph PyTorch builds can be compared with attention_cudnn.cpp's.
# usage: [OUT=dir] bash scripts/gpu/cudnn_sdpa_log.sh  ->  ${OUT:-out}/cudnn_api.log, cudnn_frontend.log,
#        torch.txt (needs PyTorch with CUDA)
# cuDNN 9 names: CUDNN_LOGLEVEL_DBG (0 off .. 3 info: every backend call and attribute) and
# CUDNN_LOGDEST_DBG (stdout, stderr or a file); CUDNN_LOGINFO_DBG is the deprecated cuDNN 8 name.
set -u
out=${OUT:-out}; mkdir -p "$out"
export CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG="$out/cudnn_api.log"
export CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE="$out/cudnn_frontend.log"
python3 - <<'PY' > "$out/torch.txt" 2>&1
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
q = torch.randn(1, 12, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(6, dim=1), v.repeat_interleave(6, dim=1), is_causal=True)
    o.backward(torch.randn_like(o))
torch.cuda.synchronize()
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "out", tuple(o.shape), "ok")
PY
echo "rc=$? $(tail -1 "$out/torch.txt")"; ls -la "$out"
