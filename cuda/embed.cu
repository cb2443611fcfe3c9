// bitexact: embedding lookup with dequantization (docs/determinism.md section 4).
// Launcher: node/backend_cuda.py launch_embed. Twin: node/reference.py embed.
#include "common.cuh"

// out fp32 [M, K] = dequantized rows tokens[m] of W: s * code (+ o).
extern "C" __global__ void embed(const unsigned char* __restrict__ W, int qtype, int row_bytes,
                                 const long long* __restrict__ tokens, float* __restrict__ out, int M, int K) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * K) return;
    int m = (int)(i / K), k = (int)(i % K);
    const unsigned char* row = W + (size_t)tokens[m] * row_bytes;
    int b = k >> 5, e = k & 31;
    float s, w;
    int code;
    bool asym = false;
    float o = 0.0f;
    if (qtype == BX_F32) { out[i] = ((const float*)row)[k]; return; }
    if (qtype == BX_F16) { out[i] = bx_half(((const unsigned short*)row)[k]); return; }
    if (qtype == BX_BF16) { out[i] = bx_bf16(((const unsigned short*)row)[k]); return; }
    if (qtype == BX_Q8_0) {
        const unsigned char* blk = row + 34 * b;
        s = bx_half(bx_u16(blk));
        code = (int)(signed char)blk[2 + e];
    } else if (qtype == BX_Q4_0 || qtype == BX_Q4_1) {
        int bb = qtype == BX_Q4_0 ? 18 : 20;
        const unsigned char* blk = row + bb * b;
        int nib = e < 16 ? (blk[bb - 16 + e] & 0xF) : (blk[bb - 16 + e - 16] >> 4);
        s = bx_half(bx_u16(blk));
        code = qtype == BX_Q4_0 ? nib - 8 : nib;
        if (qtype == BX_Q4_1) { asym = true; o = bx_half(bx_u16(blk + 2)); }
    } else if (qtype == BX_Q4_K) {
        const unsigned char* sup = row + 144 * (b >> 3);
        int j = b & 7, sc, mn;
        bx_q4k_scale_min(sup + 4, j, &sc, &mn);
        s = __fmul_rn(bx_half(bx_u16(sup)), (float)sc);
        o = -__fmul_rn(bx_half(bx_u16(sup + 2)), (float)mn);
        asym = true;
        int byte = sup[16 + 32 * (j >> 1) + e];
        code = (j & 1) ? (byte >> 4) : (byte & 0xF);
    } else {  // BX_Q6_K
        const unsigned char* sup = row + 210 * (b >> 3);
        int sb = b & 7;
        s = bx_half(bx_u16(sup + 208));
        code = (int)(signed char)sup[192 + 2 * sb + (e >> 4)] * (bx_q6k_value(sup, sb, e) - 32);
    }
    w = __fmul_rn(s, (float)code);
    out[i] = asym ? __fadd_rn(w, o) : w;
}
