#!/usr/bin/env python3
"""Turns the GPU's measured reciprocals (testdata/nf4/rcp.npz, written by make_nf4_refs.py) into the
table spindle's CPU quantiser reads: src/backend/cpu/rcp_approx_f32.bin.

rcp.approx.ftz.f32 (what bitsandbytes' `1.0f / absmax` compiles to under --use_fast_math) is faithful:
for every float x in [1, 2) it returns one of the two floats around 1/x, and it scales exactly with the
exponent. So one bit per mantissa says which: bit m (byte m >> 3, bit m & 7) is set when the result for
1 + m·2⁻²³ is not the correctly rounded reciprocal. 2²³ bits = 1 MiB.

Usage: python3 scripts/gpu/rcp_table.py testdata/nf4/rcp.npz src/backend/cpu/rcp_approx_f32.bin
"""
import sys

import numpy as np

delta = np.load(sys.argv[1])["delta"]
assert delta.shape == (1 << 23,) and set(np.unique(delta)) <= {-1, 0, 1}
np.packbits(delta != 0, bitorder="little").tofile(sys.argv[2])
print(f"{int(np.count_nonzero(delta))} of {delta.size} mantissas differ from the correctly rounded reciprocal")
