#!/usr/bin/env python3
"""Reference rates on the GPU host: PyTorch SDPA (cuDNN and FlashAttention-2 backends) on the shape
bench_cuda measures (32k tokens causal, Hq=12, Hkv=2 expanded to 12, D=128, bf16). Same FLOP
convention as bench_cuda: forward 4·D·Hq·T(T+1)/2, backward 2.5x forward. Prints one line per row."""
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


def main():
    t, hq, d = 32768, 12, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.rand(1, hq, t, d, device="cuda", generator=g) * 4 - 2).bfloat16().requires_grad_()
    k = (torch.rand(1, hq, t, d, device="cuda", generator=g) * 4 - 2).bfloat16().requires_grad_()
    v = (torch.rand(1, hq, t, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
    dout = (torch.rand(1, hq, t, d, device="cuda", generator=g) * 2 - 1).bfloat16()
    fwd_flops = 4.0 * d * hq * t * (t + 1) / 2
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                f_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                fb_ms = median_ms(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout))
            b_ms = fb_ms - f_ms
            print(f"torch {name:7s} T={t} causal: fwd {f_ms:7.3f} ms {fwd_flops / f_ms / 1e9:6.1f} TFLOP/s | "
                  f"bwd {b_ms:7.3f} ms {2.5 * fwd_flops / b_ms / 1e9:6.1f} | "
                  f"fwd+bwd {fb_ms:7.3f} ms {3.5 * fwd_flops / fb_ms / 1e9:6.1f} TFLOP/s", flush=True)
            del out
        except Exception as e:  # a backend may be unavailable for this shape
            print(f"torch {name}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
