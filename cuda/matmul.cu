// bitexact: matrix products (docs/determinism.md section 5).
// Kernels: quantize_q8, matmul_q, lane_major, matmul_f. Launchers with shape
// checks: node/backend_cuda.py (launch_quantize_q8, launch_matmul_q,
// launch_lane_major, launch_matmul_f), in the same order. Twins:
// node/reference.py quantize_q8, matmul_q, lane_major, matmul_f.
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
// order, then the xor-butterfly: the contract's warp_sum over blocks. Up to
// three matrices with the same K (Q/K/V, gate/up) in one launch, rows
// concatenated; grid x walks token tiles so a row's tiles run together.
// A tensor-parallel shard of K (docs/determinism.md section 12) is computed
// by sub-warps of `lanes` lanes, 32/lanes rows per warp: sub-lane l adds the
// shard's blocks l*g .. l*g+g-1 (of nbs; the weight rows hold the shard only,
// from block b_off of their first super-block, and x's block is blk0 + b),
// then the lowest log2(lanes) butterfly levels give the shard's partial.
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

extern "C" __global__ void matmul_q(const unsigned char* __restrict__ W0, const unsigned char* __restrict__ W1,
                                    const unsigned char* __restrict__ W2, float* __restrict__ y0,
                                    float* __restrict__ y1, float* __restrict__ y2, int N0, int N1, int N2,
                                    int qt0, int qt1, int qt2, int rb0, int rb1, int rb2,
                                    const signed char* __restrict__ xq, const float* __restrict__ xd,
                                    const int* __restrict__ xa, int M, int K, int g, int lanes, int blk0,
                                    int b_off, int nbs) {
    int lane = threadIdx.x & 31;
    int per = 32 / lanes, sub = lane / lanes, l = lane & (lanes - 1);  // rows per warp, sub-warp, sub-lane
    int w = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int w0 = (N0 + per - 1) / per, w1 = (N1 + per - 1) / per, w2 = (N2 + per - 1) / per;
    const unsigned char* W = W0;
    float* y = y0;
    int N = N0, qtype = qt0, row_bytes = rb0;
    if (w >= w0) {
        w -= w0;
        W = W1; y = y1; N = N1; qtype = qt1; row_bytes = rb1;
        if (w >= w1) {
            w -= w1;
            W = W2; y = y2; N = N2; qtype = qt2; row_bytes = rb2;
            if (w >= w2) return;  // uniform per warp
        }
    }
    int n = w * per + sub;
    bool live = n < N;  // a sub-warp past the last row reads row N-1 and writes nothing
    int nb = K >> 5;
    int m0 = blockIdx.x * MQ_TM;
    bool asym = qtype == BX_Q4_1 || qtype == BX_Q4_K;
    const unsigned char* row = W + (size_t)min(n, N - 1) * row_bytes;
    float acc[MQ_TM];
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) acc[t] = 0.0f;
    for (int j = 0; j < g; ++j) {
        int b = l * g + j;
        if (b >= nbs) break;
        int codes[8], sca, scb;
        float s, o;
        bx_load_block(row, qtype, b + b_off, codes, &s, &o, &sca, &scb);
        int xb = blk0 + b;
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) {
            int m = m0 + t;
            if (m >= M) break;
            const int4* qa = (const int4*)(xq + (size_t)m * K + 32 * xb);  // 16-byte aligned: K % 32 == 0
            int4 a0 = qa[0], a1 = qa[1];
            int i0 = __dp4a(codes[3], a0.w, __dp4a(codes[2], a0.z, __dp4a(codes[1], a0.y, __dp4a(codes[0], a0.x, 0))));
            int i1 = __dp4a(codes[7], a1.w, __dp4a(codes[6], a1.z, __dp4a(codes[5], a1.y, __dp4a(codes[4], a1.x, 0))));
            int isum = sca * i0 + scb * i1;
            float da = xd[(size_t)m * nb + xb];
            float r = __fmul_rn(__fmul_rn(s, da), (float)isum);
            if (asym) r = __fadd_rn(r, __fmul_rn(__fmul_rn(o, da), (float)xa[(size_t)m * nb + xb]));
            acc[t] = __fadd_rn(acc[t], r);
        }
    }
#pragma unroll
    for (int t = 0; t < MQ_TM; ++t) {
        float v = bx_butterfly_lanes(acc[t], lanes);
        if (l == 0 && live && m0 + t < M) y[(size_t)(m0 + t) * N + n] = v;
    }
}

// ---- lane_major: x [M, K] -> the lane-major layout matmul_f reads ----------
// Element (l, j, e) = x[m, l*g + j*V + e] moves to (j*32 + l)*V + e, g = K/32.
// A pure permutation. Twin: node/reference.py lane_major.
extern "C" __global__ void lane_major(const float* __restrict__ x, float* __restrict__ xl, int M, int K, int V) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * K) return;
    int m = (int)(i / K), c = (int)(i % K);
    int e = c % V, l = (c / V) & 31, j = c / (32 * V);
    xl[i] = x[(size_t)m * K + (size_t)l * (K >> 5) + j * V + e];
}

// ---- matmul_f: F32/F16/BF16 weights, fp32 products, warp_sum over K ---------
// Weights and x are lane-major (node/reference.py lane_major) with chunks of V
// elements, so at step j the warp reads its 32 lanes' chunks as one contiguous
// span (coalesced), yet lane l still adds the products of k = l*g .. l*g+g-1
// one by one in ascending k, then the butterfly: the contract's warp_sum.
// One warp per MF_ROWS output rows (each x chunk loaded once for all of them),
// MQ_TM tokens per warp; up to three matrices with the same K and type
// (Q/K/V, gate/up) in one launch, each starting at a warp of its own.
// A tensor-parallel shard of K (docs/determinism.md section 12) is computed
// by sub-warps of `lanes` lanes (32/lanes sub-warps, MF_ROWS rows each): the
// weight rows hold the shard's lanes only, lane-major over `lanes` lanes
// (chunk j*lanes + l), sub-lane l reads x's chunk j*32 + lane0 + l, and the
// lowest log2(lanes) butterfly levels give the shard's partial.
// Tile constants, chosen by timing variants on one NVIDIA H200 over the 8B
// shapes at batch 1, 8 and 32 (scripts/tune_matmul_f.py compiles variants with
// -D; docs/benchmarks.md); none changes any sum. The node compiles the defaults.
#ifndef MF_WARPS
#define MF_WARPS 8   // warps per block (node/backend_cuda.py MF_WARPS)
#endif
#ifndef MF_ROWS
#define MF_ROWS 2    // output rows per warp (node/backend_cuda.py MF_ROWS)
#endif
#ifndef MF_BYTES
#define MF_BYTES 32  // weight bytes in flight per lane and row
#endif
#ifndef MF_MINB
#define MF_MINB 3    // __launch_bounds__ minimum blocks per SM (<= 80 registers)
#endif

template <int WT, int V>
__device__ __forceinline__ void bx_decode_chunk(const unsigned int* u, float* w) {
    if (WT == BX_F32) {
#pragma unroll
        for (int i = 0; i < V; ++i) w[i] = __uint_as_float(u[i]);
    } else if (V == 1) {
        unsigned short h = (unsigned short)(u[0] & 0xFFFFu);
        w[0] = WT == BX_F16 ? bx_half(h) : bx_bf16(h);
    } else {
#pragma unroll
        for (int i = 0; i < V / 2; ++i) {
            unsigned short lo = (unsigned short)(u[i] & 0xFFFFu), hi = (unsigned short)(u[i] >> 16);
            w[2 * i] = WT == BX_F16 ? bx_half(lo) : bx_bf16(lo);
            w[2 * i + 1] = WT == BX_F16 ? bx_half(hi) : bx_bf16(hi);
        }
    }
}

// Chunk of V elements of WT: CB bytes, loaded as NW 32-bit words (or one 16-bit).
template <int WT, int V>
struct BxChunk {
    static constexpr int CB = V * (WT == BX_F32 ? 4 : 2);
    static constexpr int NW = CB >= 4 ? CB / 4 : 1;
    static constexpr int U = CB >= 8 && MF_BYTES >= CB ? MF_BYTES / CB : (CB >= 8 ? 1 : 8);  // chunks in flight
    unsigned int u[NW];
    __device__ __forceinline__ void load(const unsigned char* __restrict__ row, int idx) {
        const unsigned char* p = row + (size_t)idx * CB;
        if (CB == 16) {
            uint4 v = *(const uint4*)p;
            u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
        } else if (CB == 8) {
            uint2 v = *(const uint2*)p;
            u[0] = v.x; u[1] = v.y;
        } else if (CB == 4) {
            u[0] = *(const unsigned int*)p;
        } else {
            u[0] = *(const unsigned short*)p;
        }
    }
};

template <int V>
__device__ __forceinline__ void bx_load_x(const float* __restrict__ p, float* xv) {
    if (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 4) {
            float4 f = *(const float4*)(p + i);
            xv[i] = f.x; xv[i + 1] = f.y; xv[i + 2] = f.z; xv[i + 3] = f.w;
        }
    } else if (V == 2) {
        float2 f = *(const float2*)p;
        xv[0] = f.x; xv[1] = f.y;
    } else {
        xv[0] = p[0];
    }
}

// Rows n0 + sub*MF_ROWS .. of W for sub-warp sub (rows past N read row N-1 and are not written).
template <int WT, int V, int LANES>
__device__ __forceinline__ void bx_matmul_f_rows(const unsigned char* __restrict__ W, const float* __restrict__ xl,
                                                 float* __restrict__ y, int n0, int N, int M, int m0, int K,
                                                 int lane, int lane0) {
    constexpr int lanes = LANES;
    using C = BxChunk<WT, V>;
    int sub = lane / lanes, l = lane & (lanes - 1);
    n0 += sub * MF_ROWS;
    const unsigned char* rows[MF_ROWS];
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
        rows[r] = W + (size_t)min(n0 + r, N - 1) * (lanes * (K >> 5)) * (WT == BX_F32 ? 4 : 2);
    int nj = (K >> 5) / V;
    int xlane = lane0 + l;  // the contract lane whose x chunks this sub-lane reads
    float acc[MF_ROWS][MQ_TM];
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) acc[r][t] = 0.0f;
    for (int j0 = 0; j0 < nj; j0 += C::U) {
        C w[MF_ROWS][C::U];
#pragma unroll
        for (int u = 0; u < C::U; ++u)
#pragma unroll
            for (int r = 0; r < MF_ROWS; ++r)
                if (j0 + u < nj) w[r][u].load(rows[r], (j0 + u) * lanes + l);
#pragma unroll
        for (int u = 0; u < C::U; ++u) {
            if (j0 + u >= nj) break;
            asm volatile("" ::: "memory");  // keep x loads per chunk: bounds registers
            float wf[MF_ROWS][V];
#pragma unroll
            for (int r = 0; r < MF_ROWS; ++r) bx_decode_chunk<WT, V>(w[r][u].u, wf[r]);
#pragma unroll
            for (int t = 0; t < MQ_TM; ++t) {
                if (m0 + t >= M) break;
                float xv[V];
                bx_load_x<V>(xl + (size_t)(m0 + t) * K + (size_t)((j0 + u) * 32 + xlane) * V, xv);
#pragma unroll
                for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[r][t] = __fadd_rn(acc[r][t], __fmul_rn(xv[e], wf[r][e]));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) {
            float v = bx_butterfly_lanes(acc[r][t], LANES);
            if (l == 0 && m0 + t < M && n0 + r < N) y[(size_t)(m0 + t) * N + n0 + r] = v;
        }
}

// Not inlined: with every (type, lanes) body inlined into one kernel the
// register allocator spills; as calls each body gets the 80 registers alone.
template <int WT, int LANES>
__device__ __noinline__ void bx_matmul_f_v(int V, const unsigned char* W, const float* xl, float* y, int n0,
                                              int N, int M, int m0, int K, int lane, int lane0) {
    if (V == 8) bx_matmul_f_rows<WT, (WT == BX_F32 ? 4 : 8), LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (V == 4) bx_matmul_f_rows<WT, 4, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (V == 2) bx_matmul_f_rows<WT, 2, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else bx_matmul_f_rows<WT, 1, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
}

// The shard's lane count as a template argument, so the full warp's code is unchanged.
template <int WT>
__device__ __forceinline__ void bx_matmul_f_t(int V, const unsigned char* W, const float* xl, float* y, int n0,
                                              int N, int M, int m0, int K, int lane, int lanes, int lane0) {
    if (lanes == 32) bx_matmul_f_v<WT, 32>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (lanes == 16) bx_matmul_f_v<WT, 16>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (lanes == 8) bx_matmul_f_v<WT, 8>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else bx_matmul_f_v<WT, 4>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
}

extern "C" __global__ void __launch_bounds__(32 * MF_WARPS, MF_MINB)
matmul_f(const unsigned char* __restrict__ W0, const unsigned char* __restrict__ W1,
         const unsigned char* __restrict__ W2, float* __restrict__ y0, float* __restrict__ y1,
         float* __restrict__ y2, int N0, int N1, int N2, int wtype, int V, const float* __restrict__ xl, int M,
         int K, int lanes, int lane0) {
    int lane = threadIdx.x & 31;
    int w = blockIdx.y * MF_WARPS + (threadIdx.x >> 5);  // warp index over the matrices' warps
    int per = MF_ROWS * (32 / lanes);                     // rows per warp
    int w0 = (N0 + per - 1) / per, w1 = (N1 + per - 1) / per, w2 = (N2 + per - 1) / per;
    const unsigned char* W = W0;
    float* y = y0;
    int N = N0;
    if (w >= w0) {
        w -= w0;
        W = W1; y = y1; N = N1;
        if (w >= w1) {
            w -= w1;
            W = W2; y = y2; N = N2;
            if (w >= w2) return;  // uniform per warp
        }
    }
    int m0 = blockIdx.x * MQ_TM;
    if (wtype == BX_F32) bx_matmul_f_t<BX_F32>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
    else if (wtype == BX_F16) bx_matmul_f_t<BX_F16>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
    else bx_matmul_f_t<BX_BF16>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
}
