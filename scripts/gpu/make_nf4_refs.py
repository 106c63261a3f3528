#!/usr/bin/env python3
"""Makes the bitsandbytes 4-bit references that tests/quant checks spindle's NF4/FP4 code against.

Runs on the GPU host (bitsandbytes' 4-bit kernels are CUDA kernels, built with --use_fast_math; the
references must come from them, not from a CPU re-implementation). bitsandbytes is not installed
there: bring its wheel (scripts/gpu/README.md, "QLoRA references"). Writes, under OUT_DIR:

  nf4/quant.safetensors   for every input tensor `in.<name>` (F32/BF16/F16, as given to bnb) and
                          every case `<case>.`: packed (U8 [(n+1)/2], bnb's bytes), absmax (F32
                          [blocks], or U8 codes with double quantisation), nested_absmax (F32),
                          offset (F32 [1]), absmax_deq (F32, bnb's dequantised absmax, double
                          quantisation only), dequant_f32 (F32 [n], bnb's dequantize_4bit to
                          float32), dequant_bf16 (BF16, some cases); tables quant_map.nf4,
                          quant_map.fp4 (F32 [16]) and dynamic_map (F32 [256], the nested code).
                          The metadata key "cases" lists each case as JSON (input, blocksize,
                          quant_type, double_quant).
  nf4/rcp.npz             the GPU's rcp.approx.ftz.f32 (what bnb's `1.0f / absmax` compiles to)
                          for every float in [1, 2): delta[m] = bits(rcp.approx(1 + m·2⁻²³)) −
                          bits(rcp.rn(same)), int8 [2²³]; and a JSON summary of the checks below.

Usage: python3 make_nf4_refs.py OUT_DIR
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

import bitsandbytes
import bitsandbytes.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
DEVICE = os.environ.get("NF4_REFS_DEVICE", "cuda")

# bnb's NF4 decision thresholds (midpoints of adjacent table entries), as fp32.
NF4_THRESHOLDS = [-0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
                  -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
                  0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
                  0.5016634166240692, 0.6427869200706482, 0.8614784181118011]
FP4_THRESHOLDS = [0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333]


def f32(x):
    return torch.tensor(x, dtype=torch.float32)


def threshold_block(scale, rng, thresholds):
    """64 values whose scaled versions sit exactly on, just above and just below the thresholds."""
    t = torch.tensor(thresholds + [-x for x in thresholds if x > 0], dtype=torch.float32)
    a = f32(scale)
    on = (t * a).to(torch.float32)
    up = torch.nextafter(on, torch.full_like(on, float("inf")))
    down = torch.nextafter(on, torch.full_like(on, float("-inf")))
    vals = torch.cat([a.reshape(1), on, up, down])
    if vals.numel() < 64:
        fill = (torch.rand(64 - vals.numel(), generator=rng) * 2 - 1) * a
        vals = torch.cat([vals, fill])
    vals = vals[:64]
    # The absmax must be `scale` itself: clamp anything a rounding pushed past it.
    return torch.clamp(vals, -a, a)


def special_input(rng):
    """[24, 64] F32: one block of 64 per row, each probing an edge of the quantiser."""
    rows = []
    rows.append(torch.zeros(64))                                             # all +0
    rows.append(torch.where(torch.rand(64, generator=rng) < 0.5, 0.0, -0.0))  # ±0
    den = torch.randint(1, 1 << 23, (64,), generator=rng).to(torch.int32).view(torch.float32)
    rows.append(den * torch.where(torch.rand(64, generator=rng) < 0.5, 1.0, -1.0))  # denormals only
    r = den.clone()
    r[5] = 0.25
    rows.append(r)                                                           # denormals + one normal
    rows.append(threshold_block(1.0, rng, NF4_THRESHOLDS))
    for scale in [0.7310000061988831, 3.1e-3, 17.3, 1e-20, 5.5e5, 0.1, 1.9999999, 1.0000001]:
        rows.append(threshold_block(scale, rng, NF4_THRESHOLDS))
    rows.append(threshold_block(0.6180339, rng, FP4_THRESHOLDS))
    rows.append(torch.randn(64, generator=rng) * 3e-38)                      # products below 2^-126
    rows.append(torch.randn(64, generator=rng) * 1e37)                       # huge
    one = torch.zeros(64)
    one[17] = -0.03
    rows.append(one)                                                         # a single nonzero
    neg = torch.randn(64, generator=rng)
    neg[3] = -10.0
    rows.append(neg)                                                         # the absmax is negative
    while len(rows) < 24:
        rows.append(torch.randn(64, generator=rng))
    return torch.stack(rows).to(torch.float32)


def inputs():
    rng = torch.Generator().manual_seed(1234)
    return {
        "special_f32": special_input(rng),
        "normal_bf16": (torch.randn(64, 96, generator=rng) * 0.02).to(torch.bfloat16),
        "odd_f32": torch.randn(5, 13, generator=rng),
        "partial_f16": (torch.randn(7, 100, generator=rng) * 0.5).to(torch.float16),
        "wide_f32": torch.randn(16, 512, generator=rng) * 0.05,
        "big_f32": torch.randn(128, 512, generator=rng) * 0.02,
    }


# (case, input, blocksize, quant_type, double_quant, keep a BF16 dequant)
CASES = [
    ("special_nf4_64", "special_f32", 64, "nf4", False, True),
    ("special_nf4_64_dq", "special_f32", 64, "nf4", True, False),
    ("special_nf4_128", "special_f32", 128, "nf4", False, False),
    ("special_nf4_32", "special_f32", 32, "nf4", False, False),
    ("special_fp4_64", "special_f32", 64, "fp4", False, True),
    ("special_fp4_64_dq", "special_f32", 64, "fp4", True, False),
    ("normal_nf4_64", "normal_bf16", 64, "nf4", False, True),
    ("normal_nf4_64_dq", "normal_bf16", 64, "nf4", True, True),
    ("normal_nf4_128", "normal_bf16", 128, "nf4", False, False),
    ("normal_nf4_128_dq", "normal_bf16", 128, "nf4", True, False),
    ("normal_fp4_64", "normal_bf16", 64, "fp4", False, False),
    ("odd_nf4_64", "odd_f32", 64, "nf4", False, False),
    ("odd_fp4_64", "odd_f32", 64, "fp4", False, False),
    ("partial_nf4_64_dq", "partial_f16", 64, "nf4", True, False),
    ("partial_nf4_256", "partial_f16", 256, "nf4", False, False),
    ("wide_nf4_256", "wide_f32", 256, "nf4", False, False),
    ("wide_nf4_512", "wide_f32", 512, "nf4", False, False),
    ("wide_nf4_1024", "wide_f32", 1024, "nf4", False, False),
    ("wide_nf4_2048", "wide_f32", 2048, "nf4", False, False),
    ("wide_nf4_4096", "wide_f32", 4096, "nf4", False, False),
    ("wide_nf4_4096_dq", "wide_f32", 4096, "nf4", True, False),
    ("big_nf4_64_dq", "big_f32", 64, "nf4", True, False),
]


def quant_refs():
    tensors = {}
    meta = []
    ins = inputs()
    for name, t in ins.items():
        tensors["in." + name] = t.contiguous()
    for case, src, blocksize, qtype, dq, keep_bf16 in CASES:
        a = ins[src].to(DEVICE)
        packed, state = F.quantize_4bit(a, blocksize=blocksize, compress_statistics=dq, quant_type=qtype,
                                        quant_storage=torch.uint8)
        tensors[case + ".packed"] = packed.reshape(-1).cpu().contiguous()
        tensors[case + ".absmax"] = state.absmax.cpu().contiguous()
        if dq:
            tensors[case + ".nested_absmax"] = state.state2.absmax.cpu().contiguous()
            tensors[case + ".offset"] = state.offset.reshape(1).float().cpu()
            absmax_deq = F.dequantize_blockwise(state.absmax, state.state2)
            absmax_deq += state.offset
            tensors[case + ".absmax_deq"] = absmax_deq.float().cpu().contiguous()
            tensors["dynamic_map"] = state.state2.code.float().cpu().contiguous()
        absmax = tensors[case + ".absmax_deq"].to(DEVICE) if dq else state.absmax
        out32 = torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, qtype, a.shape, torch.float32)
        # The public entry point too (it dequantises the nested absmax itself): must agree.
        public = F.dequantize_4bit(packed, state).float()
        if not torch.equal(public.view(torch.int32), out32.view(torch.int32)) and a.dtype == torch.float32:
            print(f"{case}: dequantize_4bit differs from the op on the dequantised absmax")
        tensors[case + ".dequant_f32"] = out32.reshape(-1).cpu().contiguous()
        if keep_bf16:
            out16 = torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, qtype, a.shape,
                                                                   torch.bfloat16)
            tensors[case + ".dequant_bf16"] = out16.reshape(-1).cpu().contiguous()
        meta.append({"case": case, "input": src, "blocksize": blocksize, "quant_type": qtype, "double_quant": dq,
                     "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", "")})
        print(f"{case}: n {a.numel()} packed {packed.numel()} absmax {tuple(state.absmax.shape)}"
              f" {state.absmax.dtype}" + (f" offset {state.offset.item()!r}" if dq else ""))
    tensors["quant_map.nf4"] = F.get_4bit_type("nf4", device="cpu").float().contiguous()
    tensors["quant_map.fp4"] = F.get_4bit_type("fp4", device="cpu").float().contiguous()
    os.makedirs(os.path.join(OUT, "nf4"), exist_ok=True)
    save_file(tensors, os.path.join(OUT, "nf4", "quant.safetensors"),
              metadata={"cases": json.dumps(meta), "bitsandbytes": bitsandbytes.__version__,
                        "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE})


RCP_SRC = r'''
extern "C" __global__ void rcp_approx(const unsigned int* in, unsigned int* out, long long n) {
  long long i = blockDim.x * (long long)blockIdx.x + threadIdx.x;
  if (i >= n) return;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__uint_as_float(in[i])));
  out[i] = __float_as_uint(r);
}
extern "C" __global__ void rcp_rn(const unsigned int* in, unsigned int* out, long long n) {
  long long i = blockDim.x * (long long)blockIdx.x + threadIdx.x;
  if (i >= n) return;
  out[i] = __float_as_uint(__frcp_rn(__uint_as_float(in[i])));
}
extern "C" __global__ void div_fast(const unsigned int* in, unsigned int* out, long long n) {
  long long i = blockDim.x * (long long)blockIdx.x + threadIdx.x;
  if (i >= n) return;
  out[i] = __float_as_uint(1.0f / __uint_as_float(in[i]));
}
'''


def rcp_refs():
    """The hardware reciprocal bnb's quantiser uses, measured on every mantissa."""
    import cupy as cp

    plain = cp.RawModule(code=RCP_SRC, options=("--std=c++17",))
    fast = cp.RawModule(code=RCP_SRC, options=("--std=c++17", "--use_fast_math"))
    approx, rn, div_fast = plain.get_function("rcp_approx"), plain.get_function("rcp_rn"), fast.get_function("div_fast")
    n = 1 << 23

    def run(fn, bits):
        out = cp.empty_like(bits)
        fn(((bits.size + 255) // 256,), (256,), (bits, out, cp.int64(bits.size)))
        return out

    mant = cp.arange(n, dtype=cp.uint32)
    base = mant | cp.uint32(127 << 23)
    r_approx = run(approx, base)
    r_rn = run(rn, base)
    delta = (r_approx.astype(cp.int64) - r_rn.astype(cp.int64))
    summary = {"max_abs_delta": int(cp.abs(delta).max()), "nonzero": int(cp.count_nonzero(delta)),
               "fast_math_division_equals_rcp_approx": bool(cp.all(run(div_fast, base) == r_approx))}
    # Scale invariance: rcp(m·2^e) = rcp(m)·2^-e while both stay normal.
    shifts = {}
    for e in [1, 20, 64, 120, 126, 127 + 20, 127 + 100, 253, 254]:
        bits = mant | cp.uint32(e << 23)
        got = run(approx, bits).astype(cp.int64)
        expect_exp = (r_approx.astype(cp.int64) >> 23) - (e - 127)
        expect = ((expect_exp << 23) | (r_approx.astype(cp.int64) & 0x7FFFFF))
        ok = (expect_exp >= 1) & (expect_exp <= 254)
        shifts[str(e)] = {"mismatch_where_normal": int(cp.count_nonzero((got != expect) & ok)),
                          "results_where_not_normal": sorted({hex(int(v)) for v in cp.unique(got[~ok])[:8].get()})}
    summary["scale"] = shifts
    specials = [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x80400000, 0x00800000, 0x7F7FFFFF, 0x7F000000,
                0x7E800000, 0x7E800001, 0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800000, 0xBF800000, 0x3FFFFFFF]
    sp = run(approx, cp.asarray(specials, dtype=cp.uint32)).get()
    summary["specials"] = {hex(a): hex(int(b)) for a, b in zip(specials, sp)}
    os.makedirs(os.path.join(OUT, "nf4"), exist_ok=True)
    np.savez_compressed(os.path.join(OUT, "nf4", "rcp.npz"), delta=delta.astype(cp.int8).get(),
                        summary=np.frombuffer(json.dumps(summary).encode(), dtype=np.uint8))
    print("rcp.approx.ftz.f32:", json.dumps(summary)[:2000])


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    print("bitsandbytes", bitsandbytes.__version__, "torch", torch.__version__, DEVICE)
    quant_refs()
    rcp_refs()


if __name__ == "__main__":
    main()
