// bitexact: a measurement, not a kernel of the node. One launch runs a whole
// batch-1 decode step of a Llama-3.1-8B-shaped BF16 model: every layer's
// RMSNorms, Q/K/V with RoPE and the KV store, split-KV attention (one split:
// positions < SPLIT_KV), O with its residual, gate/up with the SiLU gate,
// down with its residual, then the final RMSNorm and the LM head. Each
// product and elementwise step does the contract's operations in the
// contract's order (docs/determinism.md; twins in node/reference.py), so
// scripts/probe_step.py checks its bytes against the numpy engine.
//
// Phases are separated by a grid barrier without atomics: each block stores
// the barrier's number into its own flag (st.release) and polls every
// block's flag (ld.acquire). Each warp computes pairs of adjacent rows (a
// RoPE pair, a gate row and its up row, or two rows) and streams their
// weights with cp.async through a ring of PS_STAGES stages of 1 KB in shared
// memory; the ring runs on across phases and layers (weights never depend
// on a barrier). A phase's input vector is staged per block in shared
// memory in the lane-major order of V = 8, normalised there for RMSNorm
// phases (its loads, the norm weights' too, all in flight at once). Weights
// are lane-major with V = 8 (node/reference.py lane_major); gate/up rows
// interleaved (gate j, up j). Attention: four blocks per query head, each
// computing every score (a warp per slot, the contract's warp_sum over the
// head dimension) and a quarter of the output dimensions; the layer's
// cached keys and values are hinted into L2 during Q/K/V. Epilogue operands
// (the residual, the RoPE table row) are loaded before a pair's product.
// A measurement on the 8B shape at batch 1 only: it has no tiles of several
// tokens, no split-KV combine over several splits, no paged cache.
#include "common.cuh"

#ifndef PS_WARPS
#define PS_WARPS 16
#endif
#ifndef PS_STAGES
#define PS_STAGES 8
#endif
#ifndef PS_SB
#define PS_SB 4  // float4 loads per thread and round when staging down's input (8: one round, spills)
#endif
#ifndef PS_FENCE
#define PS_FENCE 0  // 1: also a membar.gl before the release store and after the acquire loads
#endif
#define PS_D 4096
#define PS_F 14336
#define PS_HD 128
#define PS_HKV 8
#define PS_QKV (PS_D + 2 * PS_HKV * PS_HD)
#define PS_XMAX PS_F

struct PsArgs {
    const unsigned short* const* mats;  // per layer: Wqkv [6144, D], Wo [D, D], Wgu [2F, D], Wd [D, F]; then head
    const float* attn_norm;             // [layers, D]
    const float* ffn_norm;              // [layers, D]
    const float* out_norm;              // [D]
    const float* h0;                    // [D] the embedding row (layer 0's input)
    float* h;                           // [D] residual stream: the last layer's output out
    float* h1;                          // [D] residual after attention
    float* q;                           // [D] queries after RoPE
    float* att;                         // [D] attention output
    float* act;                         // [F] SiLU gate output
    float* kc;                          // [layers, HKV, P, HD]
    float* vc;                          // [layers, HKV, P, HD]
    const float* cosr;                  // [HD / 2] the RoPE table's row at pos
    const float* sinr;                  // [HD / 2]
    float* logits;                      // [vocab]
    unsigned int* flags;                // [grid] barrier flags
    unsigned long long* times;          // [5 * layers + 2] block 0's %globaltimer: start, after each barrier, end
    int layers, pos, P, vocab;
    float eps, scale;
};

__constant__ PsArgs ps_args;

__device__ __forceinline__ void ps_time(const PsArgs& a, int i) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        a.times[i] = t;
    }
}

__device__ __forceinline__ int ps_pairs(int m, int vocab) {
    return m == 0 ? PS_QKV / 2 : m == 1 ? PS_D / 2 : m == 2 ? PS_F : m == 3 ? PS_D / 2 : vocab / 2;
}
__device__ __forceinline__ int ps_k(int m) { return m == 3 ? PS_F : PS_D; }

// The producer's place in the warp's sequence of weight chunks: weight phase
// w (layer w / 4, product w % 4; w = 4 * layers: the LM head), pair p, chunk j.
struct PsCursor {
    int w, p, j;
};

__device__ __forceinline__ void ps_skip(PsCursor& c, int gw, int wend, int vocab, int layers) {
    while (c.w < wend && c.p >= ps_pairs(c.w == 4 * layers ? 4 : c.w & 3, vocab)) {
        ++c.w;
        c.p = gw;
    }
}

__device__ __forceinline__ void ps_barrier(unsigned int* flags, unsigned int e) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (PS_FENCE) __threadfence();
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(e) : "memory");
    }
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        unsigned int v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + b) : "memory");
        } while ((int)(v - e) < 0);
    }
    if (PS_FENCE) __threadfence();
    __syncthreads();
}

// x (K floats, written by other blocks) into xs in lane-major order (V = 8);
// with w: RMSNorm (node/reference.py rms_norm) applied in place.
template <int K, bool NORM>
__device__ __noinline__ void ps_stage(float* xs, float* red, const float* x, const float* w, float eps) {
    // float4 i4 of x holds elements 4 i4 .. 4 i4 + 3: one lane's chunk, contiguous in xs too
    constexpr int g = K >> 5, T = 32 * PS_WARPS, N = (K / 4 + T - 1) / T;
    static_assert(K % 4 == 0 && g % 8 == 0, "lane chunks of 8");
    float4 v[N], wv[N];
    if (!NORM && N > PS_SB) {  // a long input without norm: loads in rounds of PS_SB float4s per thread
#pragma unroll
        for (int u0 = 0; u0 < N; u0 += PS_SB) {
            float4 b[PS_SB];
#pragma unroll
            for (int u = 0; u < PS_SB; ++u) {
                int i4 = threadIdx.x + (u0 + u) * T;
                if (u0 + u < N && i4 < K / 4) b[u] = __ldcg((const float4*)x + i4);
            }
#pragma unroll
            for (int u = 0; u < PS_SB; ++u) {
                int i = 4 * (threadIdx.x + (u0 + u) * T), l = i / g, r = i - l * g;
                if (u0 + u < N && i < K) *(float4*)(xs + ((r >> 3) * 32 + l) * 8 + (r & 7)) = b[u];
            }
        }
        __syncthreads();
        return;
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {  // every load in flight before the first store
        int i4 = threadIdx.x + u * T;
        if (i4 < K / 4) {
            v[u] = __ldcg((const float4*)x + i4);
            if (NORM) wv[u] = __ldg((const float4*)w + i4);
        }
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {
        int i = 4 * (threadIdx.x + u * T), l = i / g, r = i - l * g;
        if (i < K) *(float4*)(xs + ((r >> 3) * 32 + l) * 8 + (r & 7)) = v[u];
    }
    __syncthreads();
    if (!NORM) return;
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        float acc = 0.0f;
        for (int j = 0; j < (g >> 3); ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float xv = xs[(j * 32 + lane) * 8 + e];
                acc = __fadd_rn(acc, __fmul_rn(xv, xv));
            }
        acc = bx_butterfly(acc);
        if (lane == 0)
            red[0] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, (float)K), eps)));
    }
    __syncthreads();
    float inv = red[0];
#pragma unroll
    for (int u = 0; u < N; ++u) {
        int i = 4 * (threadIdx.x + u * T), l = i / g, r = i - l * g;
        if (i < K) {
            float4 o;
            o.x = __fmul_rn(__fmul_rn(v[u].x, inv), wv[u].x);
            o.y = __fmul_rn(__fmul_rn(v[u].y, inv), wv[u].y);
            o.z = __fmul_rn(__fmul_rn(v[u].z, inv), wv[u].z);
            o.w = __fmul_rn(__fmul_rn(v[u].w, inv), wv[u].w);
            *(float4*)(xs + ((r >> 3) * 32 + l) * 8 + (r & 7)) = o;
        }
    }
    __syncthreads();
}

// Decode attention of query head hq at position pos (one split: pos < SPLIT_KV),
// node/reference.py attention; run by one block.
__device__ __noinline__ void ps_attention(const PsArgs& a, int layer, int hq, int dq, float* sm) {
    float* s = sm;                  // [SPLIT_KV] scores, then exp terms
    float* part = s + SPLIT_KV;     // [32][32] lane partials of the block's 32 output dims
    float* red = part + 32 * 32;    // [PS_WARPS + 1]
    int kvh = hq / (32 / PS_HKV), L = a.pos + 1, t = threadIdx.x;
    const float* kb = a.kc + ((size_t)(layer * PS_HKV + kvh) * a.P) * PS_HD;
    const float* vb = a.vc + ((size_t)(layer * PS_HKV + kvh) * a.P) * PS_HD;
    int lane = t & 31, wi = t >> 5;
    float4 q4 = __ldcg((const float4*)(a.q + hq * PS_HD) + lane);  // lane's dims 4 lane .. 4 lane + 3
    constexpr int SW = SPLIT_KV / PS_WARPS / 2;                      // slots per warp and round: wi + PS_WARPS k
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float4 k4[SW];
#pragma unroll
        for (int k = 0; k < SW; ++k) {
            int slot = wi + PS_WARPS * (k + SW * half);
            if (slot < L) k4[k] = __ldcg((const float4*)(kb + (size_t)slot * PS_HD) + lane);
        }
#pragma unroll
        for (int k = 0; k < SW; ++k) {
            int slot = wi + PS_WARPS * (k + SW * half);
            if (slot < L) {  // warp_sum over HD: lane sums its 4 dims, then the butterfly
                float acc = 0.0f;
                acc = __fadd_rn(acc, __fmul_rn(q4.x, k4[k].x));
                acc = __fadd_rn(acc, __fmul_rn(q4.y, k4[k].y));
                acc = __fadd_rn(acc, __fmul_rn(q4.z, k4[k].z));
                acc = __fadd_rn(acc, __fmul_rn(q4.w, k4[k].w));
                float sc = __fmul_rn(bx_butterfly(acc), a.scale);
                if (lane == 0) s[slot] = sc;
                m = fmaxf(m, sc);
            }
        }
    }
    if (lane == 0) red[wi] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < PS_WARPS; ++i) m = fmaxf(m, red[i]);
    if (t < L) s[t] = bx_exp32(__fsub_rn(s[t], m));
    __syncthreads();
    // output partials of dims 32dq .. 32dq + 31: item (c, d) sums lane c's slots 8c .. 8c + 7;
    // each thread loads its items' values first, so they are in flight together
    for (int i0 = t; i0 < 32 * 32; i0 += 2 * blockDim.x) {
        float vv[2][8];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            int i = i0 + u * blockDim.x, c = i >> 5, d = 32 * dq + (i & 31);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                vv[u][k] = i < 32 * 32 && 8 * c + k < L ? __ldcg(vb + (size_t)(8 * c + k) * PS_HD + d) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            int i = i0 + u * blockDim.x, c = i >> 5;
            if (i >= 32 * 32) break;
            float acc = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (8 * c + k < L) acc = __fadd_rn(acc, __fmul_rn(s[8 * c + k], vv[u][k]));
            part[i] = acc;
        }
    }
    if (t < 32) {  // the exp terms' sum: lane t owns slots 8t .. 8t + 7
        float acc = 0.0f;
        for (int k = 0; k < 8; ++k)
            if (8 * t + k < L) acc = __fadd_rn(acc, s[8 * t + k]);
        acc = bx_butterfly(acc);
        if (t == 0) red[PS_WARPS] = acc;
    }
    __syncthreads();
    if (t < 32) {
        float p[32];
#pragma unroll
        for (int c = 0; c < 32; ++c) p[c] = part[c * 32 + t];
        float o = bx_tree<32>(p);
        float w = bx_exp32(__fsub_rn(m, m));  // the one split's weight against the maximum over splits
        float big_l = __fadd_rn(0.0f, __fmul_rn(red[PS_WARPS], w));
        float big_o = __fadd_rn(0.0f, __fmul_rn(o, w));
        a.att[hq * PS_HD + 32 * dq + t] = __fdiv_rn(big_o, big_l);
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(32 * PS_WARPS, 1) probe_step(unsigned int epoch0) {
    const PsArgs& a = ps_args;
    extern __shared__ __align__(16) unsigned char smem[];
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    int nwg = gridDim.x * PS_WARPS, gw = wi * gridDim.x + blockIdx.x;  // pairs spread over blocks first
    unsigned char* ring = smem + wi * PS_STAGES * 1024;
    float* xs = (float*)(smem + PS_WARPS * PS_STAGES * 1024);
    float* red = xs + PS_XMAX;
    int wend = 4 * a.layers + 1;
    unsigned int e = epoch0;

    PsCursor pc{0, gw, 0};
    ps_skip(pc, gw, wend, a.vocab, a.layers);
    int ps = 0, cs = 0;  // producer's and consumer's stage
    auto issue = [&]() {
        if (pc.w < wend) {
            int m = pc.w == 4 * a.layers ? 4 : pc.w & 3, K = ps_k(m);
            const unsigned char* row = (const unsigned char*)a.mats[pc.w] + (size_t)2 * pc.p * K * 2;
            const unsigned char* src = row + (size_t)(pc.j * 32 + lane) * 16;
            unsigned int dst = (unsigned int)__cvta_generic_to_shared(ring + ps * 1024 + lane * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 512), "l"(src + (size_t)K * 2));
            if (++pc.j == (K >> 8)) {
                pc.j = 0;
                pc.p += nwg;
                ps_skip(pc, gw, wend, a.vocab, a.layers);
            }
        }
        asm volatile("cp.async.commit_group;");
        ps = ps + 1 == PS_STAGES ? 0 : ps + 1;
    };
    // The contract's sums of two rows against xs (K elements): lane sums over
    // 8-element chunks j = 0 .. K/256 - 1 in order, then the butterfly.
    auto rows2 = [&](int K, float& y0, float& y1) {
        float a0 = 0.0f, a1 = 0.0f;
        for (int j = 0; j < (K >> 8); ++j) {
            issue();
            asm volatile("cp.async.wait_group %0;" ::"n"(PS_STAGES - 1) : "memory");
            uint4 wa = *(const uint4*)(ring + cs * 1024 + lane * 16);
            uint4 wb = *(const uint4*)(ring + cs * 1024 + 512 + lane * 16);
            cs = cs + 1 == PS_STAGES ? 0 : cs + 1;
            const float4* x4 = (const float4*)(xs + (j * 32 + lane) * 8);
            float4 xa = x4[0], xb = x4[1];
            float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            unsigned int ua[4] = {wa.x, wa.y, wa.z, wa.w}, ub[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a0 = __fadd_rn(a0, __fmul_rn(xv[2 * i], bx_bf16((unsigned short)(ua[i] & 0xFFFFu))));
                a0 = __fadd_rn(a0, __fmul_rn(xv[2 * i + 1], bx_bf16((unsigned short)(ua[i] >> 16))));
                a1 = __fadd_rn(a1, __fmul_rn(xv[2 * i], bx_bf16((unsigned short)(ub[i] & 0xFFFFu))));
                a1 = __fadd_rn(a1, __fmul_rn(xv[2 * i + 1], bx_bf16((unsigned short)(ub[i] >> 16))));
            }
        }
        y0 = bx_butterfly(a0);
        y1 = bx_butterfly(a1);
    };
    ps_time(a, 0);
    for (int i = 0; i < PS_STAGES - 1; ++i) issue();

    for (int layer = 0; layer < a.layers; ++layer) {
        // Q/K/V: RoPE on adjacent pairs, K and V into the cache at pos
        const float* hin = layer == 0 ? a.h0 : a.h;
        if (layer > 0) { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        {  // this layer's cached keys and values (positions < pos) into L2 for the attention phase
            size_t lines = (size_t)PS_HKV * a.P * PS_HD * 4 / 128;
            for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * lines;
                 i += (size_t)gridDim.x * blockDim.x) {
                size_t li = i % lines;
                if ((li * 32 / PS_HD) % a.P < (size_t)a.pos)
                    bx_prefetch_l2((i < lines ? a.kc : a.vc) + (size_t)layer * PS_HKV * a.P * PS_HD + li * 32);
            }
        }
        ps_stage<PS_D, true>(xs, red, hin, a.attn_norm + (size_t)layer * PS_D, a.eps);
        for (int p = gw; p < PS_QKV / 2; p += nwg) {
            float y0, y1;
            int r = 2 * p, i = (r % PS_HD) >> 1;
            float c = __ldg(a.cosr + i), s = __ldg(a.sinr + i);
            rows2(PS_D, y0, y1);
            if (lane == 0) {
                if (r < PS_D + PS_HKV * PS_HD) {
                    float o0 = __fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, s));
                    float o1 = __fadd_rn(__fmul_rn(y0, s), __fmul_rn(y1, c));
                    float* dst = r < PS_D ? a.q + r
                                          : a.kc + ((size_t)(layer * PS_HKV + (r - PS_D) / PS_HD) * a.P + a.pos) * PS_HD +
                                                (r - PS_D) % PS_HD;
                    dst[0] = o0;
                    dst[1] = o1;
                } else {
                    int rv = r - PS_D - PS_HKV * PS_HD;
                    float* dst = a.vc + ((size_t)(layer * PS_HKV + rv / PS_HD) * a.P + a.pos) * PS_HD + rv % PS_HD;
                    dst[0] = y0;
                    dst[1] = y1;
                }
            }
        }
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        if (blockIdx.x < 128) ps_attention(a, layer, blockIdx.x >> 2, blockIdx.x & 3, xs);
        // O and the residual
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        ps_stage<PS_D, false>(xs, red, a.att, nullptr, 0.0f);
        for (int p = gw; p < PS_D / 2; p += nwg) {
            float y0, y1, r0 = __ldcg(hin + 2 * p), r1 = __ldcg(hin + 2 * p + 1);
            rows2(PS_D, y0, y1);
            if (lane == 0) {
                a.h1[2 * p] = __fadd_rn(r0, y0);
                a.h1[2 * p + 1] = __fadd_rn(r1, y1);
            }
        }
        // gate/up and the SiLU gate
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        ps_stage<PS_D, true>(xs, red, a.h1, a.ffn_norm + (size_t)layer * PS_D, a.eps);
        for (int p = gw; p < PS_F; p += nwg) {
            float g, u;
            rows2(PS_D, g, u);
            if (lane == 0) a.act[p] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, bx_exp32(-g))), u);
        }
        // down and the residual
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        ps_stage<PS_F, false>(xs, red, a.act, nullptr, 0.0f);
        for (int p = gw; p < PS_D / 2; p += nwg) {
            float y0, y1, r0 = __ldcg(a.h1 + 2 * p), r1 = __ldcg(a.h1 + 2 * p + 1);
            rows2(PS_F, y0, y1);
            if (lane == 0) {
                a.h[2 * p] = __fadd_rn(r0, y0);
                a.h[2 * p + 1] = __fadd_rn(r1, y1);
            }
        }
    }
    { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
    ps_stage<PS_D, true>(xs, red, a.h, a.out_norm, a.eps);
    for (int p = gw; p < a.vocab / 2; p += nwg) {
        float y0, y1;
        rows2(PS_D, y0, y1);
        if (lane == 0) {
            a.logits[2 * p] = y0;
            a.logits[2 * p + 1] = y1;
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    ps_time(a, e - epoch0 + 1);
}
