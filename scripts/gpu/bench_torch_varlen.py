#!/usr/bin/env python3
"""Reference rates on the GPU host for packed rows: PyTorch SDPA on nested (jagged) tensors, which
PyTorch hands to cuDNN's ragged-offset path (THD) or to FlashAttention-2's varlen kernel, next to
the dense batch of equal sequences. 32k tokens in documents of 4k, 1k and of random lengths, causal,
Hq=12, Hkv=2 expanded to 12, D=128, bf16. FLOPs as in bench_cuda: forward 4·D·Hq per visible
(query, key) pair, backward 2.5x forward. Prints one line per row.
usage: python3 scripts/gpu/bench_torch_varlen.py [--log]  (--log: one small call only, for
cudnn_sdpa_log.sh-style API logs)"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_torch_attention import median_ms  # this script's folder is on sys.path


def jagged(offsets, hq, d, scale, g):
    """A nested tensor [B, H, j, D] (jagged) from one packed [T, H, D] buffer. Tensors that meet in
    one call must share the offsets tensor (it names their ragged dimension)."""
    t = int(offsets[-1])
    x = ((torch.rand(t, hq, d, device="cuda", generator=g) * 2 - 1) * scale).bfloat16()
    nt = torch.nested.nested_tensor_from_jagged(x, offsets=offsets)
    return nt.transpose(1, 2).detach().requires_grad_()


def bench(name, lengths, backend, hq=12, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int64)
    q, k, v = jagged(offsets, hq, d, 2.0, g), jagged(offsets, hq, d, 2.0, g), jagged(offsets, hq, d, 1.0, g)
    dout = jagged(offsets, hq, d, 1.0, g).detach()
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    fwd_flops = 4.0 * d * hq * pairs
    try:
        with sdpa_kernel(backend):
            f_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=7)
            fb_ms = median_ms(lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout), reps=7)
        b_ms = fb_ms - f_ms
        print(f"torch {backend.name.lower():18s} jagged {name:12s} causal: fwd {f_ms:7.3f} ms "
              f"{fwd_flops / f_ms / 1e9:6.1f} TFLOP/s | bwd {b_ms:7.3f} ms {2.5 * fwd_flops / b_ms / 1e9:6.1f} | "
              f"fwd+bwd {fb_ms:7.3f} ms {3.5 * fwd_flops / fb_ms / 1e9:6.1f} TFLOP/s", flush=True)
    except Exception as e:  # a backend may refuse nested inputs
        print(f"torch {backend.name.lower()} jagged {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def mixed_lengths(total=32768):
    """Documents of 256..4096 tokens filling `total`, the same as bench_cuda's packed row."""
    lengths, i = [], 0
    while sum(lengths) < total - 4096:
        lengths.append(256 + (((i + 1) * 2654435761) % 2**32) % 3841)
        i += 1
    lengths.append(total - sum(lengths))
    return lengths


def main():
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    if "--log" in sys.argv:
        bench("2 docs", [300, 724], SDPBackend.CUDNN_ATTENTION)
        return
    mixed = mixed_lengths()
    rows = (("8 x 4k", [4096] * 8), ("32 x 1k", [1024] * 32), (f"{len(mixed)} random", mixed))
    for name, lengths in rows:
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            bench(name, lengths, backend)


if __name__ == "__main__":
    main()
