// The table behind quant4::rcp_approx_ftz (backend/cpu/quant4_ops.h): one bit per float mantissa,
// set where the GPU's rcp.approx.ftz.f32 of 1 + m·2⁻²³ is not the correctly rounded reciprocal
// (it is then the other float around 1/x). Measured on the GPU host by scripts/gpu/make_nf4_refs.py
// and packed by scripts/gpu/rcp_table.py; 2²³ bits, read-only data linked into the binary.
#ifndef SPINDLE_RCP_TABLE_PATH
#error "SPINDLE_RCP_TABLE_PATH must name rcp_approx_f32.bin (backend/cpu/CMakeLists.txt)"
#endif

asm(".section .rodata\n"
    ".balign 64\n"
    ".globl spindle_rcp_approx_f32_table\n"
    ".type spindle_rcp_approx_f32_table, @object\n"
    "spindle_rcp_approx_f32_table:\n"
    ".incbin \"" SPINDLE_RCP_TABLE_PATH "\"\n"
    ".size spindle_rcp_approx_f32_table, 1048576\n"
    ".previous\n");
