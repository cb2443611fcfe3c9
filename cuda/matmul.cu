// bitexact: matrix products (docs/determinism.md section 5).
// Kernels: quantize_q8, matmul_q, matmul_f. Launchers with shape checks:
// node/backend_cuda.py (launch_quantize_q8, launch_matmul_q, launch_matmul_f),
// in the same order. Twins: node/reference.py quantize_q8, matmul_q, matmul_f.
#include "common.cuh"

// ---- quantize_q8: one warp per 32-element block of one token ----------------
extern "C" __global__ void quantize_q8(const float* __restrict__ x, signed char* __restrict__ q,
                                       float* __restrict__ d, int* __restrict__ a, int M, int K) {
    int nb = K >> 5;
    long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (gw >= (long long)M * nb) return;  // uniform per warp
    int m = (int)(gw / nb), b = (int)(gw % nb);
    float v = x[(size_t)m * K + 32 * b + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(BX_FULL, amax, off));
    float dd = __fdiv_rn(amax, 127.0f);
    int qi = 0;
    if (dd > 0.0f) {
        float t = rintf(__fdiv_rn(v, dd));
        qi = (int)fminf(fmaxf(t, -127.0f), 127.0f);
    }
    q[(size_t)m * K + 32 * b + lane] = (signed char)qi;
    int s = qi;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) s += __shfl_xor_sync(BX_FULL, s, off);  // exact integer sum
    if (lane == 0) {
        d[(size_t)m * nb + b] = dd;
        a[(size_t)m * nb + b] = s;
    }
}

// ---- matmul_q: one warp per output row n, MQ_TM tokens per warp -------------
// Lane l owns blocks l*g .. l*g+g-1 (g = ceil(nb/32)), adds r_b onto +0 in
// order, then the xor-butterfly: the contract's warp_sum over blocks.
#define MQ_TM 8

// Decode weight block b of a row into 8 words of four int8 codes, the scale s,
// the offset o and, for Q6_K, the two 16-element sub-block scales.
__device__ __forceinline__ void bx_load_block(const unsigned char* __restrict__ row, int qtype, int b,
                                              int* codes, float* s, float* o, int* sca, int* scb) {
    *o = 0.0f;
    *sca = 1;
    *scb = 1;
    if (qtype == BX_Q8_0) {
        const unsigned char* blk = row + 34 * b;
        *s = bx_half(bx_u16(blk));
#pragma unroll
        for (int w = 0; w < 8; ++w) codes[w] = (int)bx_u32_a2(blk + 2 + 4 * w);
    } else if (qtype == BX_Q4_0 || qtype == BX_Q4_1) {
        int bb = qtype == BX_Q4_0 ? 18 : 20;
        const unsigned char* blk = row + bb * b;
        const unsigned char* qs = blk + bb - 16;
        *s = bx_half(bx_u16(blk));
        if (qtype == BX_Q4_1) *o = bx_half(bx_u16(blk + 2));
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            unsigned int v = bx_u32_a2(qs + 4 * w);
            unsigned int lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
            codes[w] = (int)(qtype == BX_Q4_0 ? __vsub4(lo, 0x08080808u) : lo);
            codes[w + 4] = (int)(qtype == BX_Q4_0 ? __vsub4(hi, 0x08080808u) : hi);
        }
    } else if (qtype == BX_Q4_K) {
        const unsigned char* sup = row + 144 * (b >> 3);
        int j = b & 7, sc, mn;
        bx_q4k_scale_min(sup + 4, j, &sc, &mn);
        *s = __fmul_rn(bx_half(bx_u16(sup)), (float)sc);
        *o = -__fmul_rn(bx_half(bx_u16(sup + 2)), (float)mn);
        const uint4* qs = (const uint4*)(sup + 16 + 32 * (j >> 1));  // 16-byte aligned
        int sh = 4 * (j & 1);
        uint4 a = qs[0], c = qs[1];
        unsigned int u[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int w = 0; w < 8; ++w) codes[w] = (int)((u[w] >> sh) & 0x0F0F0F0Fu);
    } else {  // BX_Q6_K
        const unsigned char* sup = row + 210 * (b >> 3);
        int sb = b & 7;
        *s = bx_half(bx_u16(sup + 208));
        *sca = (int)(signed char)sup[192 + 2 * sb];
        *scb = (int)(signed char)sup[192 + 2 * sb + 1];
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            unsigned int v = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                v |= ((unsigned int)(bx_q6k_value(sup, sb, 4 * w + i) - 32) & 0xFFu) << (8 * i);
            codes[w] = (int)v;
        }
    }
}

extern "C" __global__ void matmul_q(const unsigned char* __restrict__ W, int qtype, int row_bytes,
                                    const signed char* __restrict__ xq, const float* __restrict__ xd,
                                    const int* __restrict__ xa, float* __restrict__ y, int M, int N, int K) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;  // uniform per warp
    int nb = K >> 5;
    int g = (nb + 31) >> 5;
    int m0 = blockIdx.y * MQ_TM;
    bool asym = qtype == BX_Q4_1 || qtype == BX_Q4_K;
    const unsigned char* row = W + (size_t)n * row_bytes;
    float acc[MQ_TM];
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) acc[t] = 0.0f;
    for (int j = 0; j < g; ++j) {
        int b = lane * g + j;
        if (b >= nb) break;
        int codes[8], sca, scb;
        float s, o;
        bx_load_block(row, qtype, b, codes, &s, &o, &sca, &scb);
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) {
            int m = m0 + t;
            if (m >= M) break;
            const int* qa = (const int*)(xq + (size_t)m * K + 32 * b);
            int i0 = 0, i1 = 0;
#pragma unroll
            for (int w = 0; w < 4; ++w) i0 = __dp4a(codes[w], qa[w], i0);
#pragma unroll
            for (int w = 4; w < 8; ++w) i1 = __dp4a(codes[w], qa[w], i1);
            int isum = sca * i0 + scb * i1;
            float da = xd[(size_t)m * nb + b];
            float r = __fmul_rn(__fmul_rn(s, da), (float)isum);
            if (asym) r = __fadd_rn(r, __fmul_rn(__fmul_rn(o, da), (float)xa[(size_t)m * nb + b]));
            acc[t] = __fadd_rn(acc[t], r);
        }
    }
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) {
        float v = bx_butterfly(acc[t]);
        if (lane == 0 && m0 + t < M) y[(size_t)(m0 + t) * N + n] = v;
    }
}

// ---- matmul_f: F32/F16/BF16 weights, fp32 products, warp_sum over K ---------
__device__ __forceinline__ float bx_load_float(const unsigned char* __restrict__ row, int wtype, int k) {
    if (wtype == BX_F32) return ((const float*)row)[k];
    unsigned short h = ((const unsigned short*)row)[k];
    return wtype == BX_F16 ? bx_half(h) : bx_bf16(h);
}

extern "C" __global__ void matmul_f(const unsigned char* __restrict__ W, int wtype, int row_bytes,
                                    const float* __restrict__ x, float* __restrict__ y, int M, int N, int K) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    int g = (K + 31) >> 5;
    int m0 = blockIdx.y * MQ_TM;
    const unsigned char* row = W + (size_t)n * row_bytes;
    float acc[MQ_TM];
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) acc[t] = 0.0f;
    int esize = wtype == BX_F32 ? 4 : 2, per16 = 16 / esize;
    if (g % per16 == 0) {
        // 16-byte loads; K only (a model dimension) selects this path, and the
        // elements are still added one by one in ascending k.
        for (int j = 0; j < g; j += per16) {
            int k = lane * g + j;
            if (k >= K) break;
            uint4 v = *(const uint4*)(row + (size_t)k * esize);
            float w[8];
            if (wtype == BX_F32) {
                w[0] = __uint_as_float(v.x); w[1] = __uint_as_float(v.y);
                w[2] = __uint_as_float(v.z); w[3] = __uint_as_float(v.w);
            } else {
                unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned short lo = (unsigned short)(u[i] & 0xFFFFu), hi = (unsigned short)(u[i] >> 16);
                    w[2 * i] = wtype == BX_F16 ? bx_half(lo) : bx_bf16(lo);
                    w[2 * i + 1] = wtype == BX_F16 ? bx_half(hi) : bx_bf16(hi);
                }
            }
#pragma unroll
            for (int t = 0; t < MQ_TM; ++t) {
                int m = m0 + t;
                if (m >= M) break;
                const float* xr = x + (size_t)m * K + k;
                for (int e = 0; e < per16; ++e) acc[t] = __fadd_rn(acc[t], __fmul_rn(xr[e], w[e]));
            }
        }
    } else {
        for (int j = 0; j < g; ++j) {
            int k = lane * g + j;
            if (k >= K) break;
            float w = bx_load_float(row, wtype, k);
#pragma unroll
            for (int t = 0; t < MQ_TM; ++t) {
                int m = m0 + t;
                if (m >= M) break;
                acc[t] = __fadd_rn(acc[t], __fmul_rn(x[(size_t)m * K + k], w));
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) {
        float v = bx_butterfly(acc[t]);
        if (lane == 0 && m0 + t < M) y[(size_t)(m0 + t) * N + n] = v;
    }
}
