#!/usr/bin/env python3
"""Reference rates on the GPU host: PyTorch SDPA (cuDNN and FlashAttention-2 backends) on the shapes
bench_cuda measures: 32k tokens causal as one sequence, and as 8 x 4k and 32 x 1k (a batch of equal
sequences: what a packed row of equal documents costs a dense-batch kernel, an upper bound on cuDNN's
ragged path), Hq=12, Hkv=2 expanded to 12, D=128, bf16. Same FLOP convention as bench_cuda: forward
4·D·Hq·T(T+1)/2 per sequence, backward 2.5x forward. Prints one line per row."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=2, reps=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench_rows(b, t, hq=12, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.rand(b, hq, t, d, device="cuda", generator=g) * 4 - 2).bfloat16().requires_grad_()
    k = (torch.rand(b, hq, t, d, device="cuda", generator=g) * 4 - 2).bfloat16().requires_grad_()
    v = (torch.rand(b, hq, t, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
    dout = (torch.rand(b, hq, t, d, device="cuda", generator=g) * 2 - 1).bfloat16()
    fwd_flops = 4.0 * d * hq * b * t * (t + 1) / 2
    rows = f"T={t}" if b == 1 else f"{b}x{t}"
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                f_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                fb_ms = median_ms(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout))
            b_ms = fb_ms - f_ms
            print(f"torch {name:7s} {rows} causal: fwd {f_ms:7.3f} ms {fwd_flops / f_ms / 1e9:6.1f} TFLOP/s | "
                  f"bwd {b_ms:7.3f} ms {2.5 * fwd_flops / b_ms / 1e9:6.1f} | "
                  f"fwd+bwd {fb_ms:7.3f} ms {3.5 * fwd_flops / fb_ms / 1e9:6.1f} TFLOP/s", flush=True)
            del out
        except Exception as e:  # a backend may be unavailable for this shape
            print(f"torch {name}: {type(e).__name__}: {e}", flush=True)


def main():
    for b, t in ((1, 32768), (8, 4096), (32, 1024)):
        bench_rows(b, t)


if __name__ == "__main__":
    main()
