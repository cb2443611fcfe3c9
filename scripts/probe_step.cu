// bitexact: a measurement, not a kernel of the node. One launch runs a whole
// decode step of a Llama-3.1-8B-shaped BF16 model for a tile of M <= 8
// tokens (each the next token of its own sequence): every layer's
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
// on a barrier); each chunk of weights is added to all M tokens. A
// phase's input (M vectors of D) is staged per block in shared memory in
// the lane-major order of V = 8, normalised there for RMSNorm phases;
// down's input (M vectors of F) is copied with cp.async in K-slices of
// PS_SL chunk steps into two buffers, the next slice while the current one
// is added, every warp of a block going through the slices in step.
// No tile, slice or split depends on M. Weights
// are lane-major with V = 8 (node/reference.py lane_major); gate/up rows
// interleaved (gate j, up j). Attention: four blocks per KV head and token,
// each computing every score of the KV head's query heads (a warp per slot,
// the contract's warp_sum over the head dimension; each key and value loaded
// once for the group) and a quarter of the output dimensions; the layer's
// cached keys and values are hinted into L2 during Q/K/V. Epilogue operands
// (the residual, the RoPE table row) are loaded before a pair's product.
// A measurement: the 8B dimensions are compiled in, one tile of tokens,
// one attention split (positions < SPLIT_KV), no paged cache.
#include "common.cuh"

#ifndef PS_WARPS
#define PS_WARPS 16
#endif
#ifndef PS_STAGES
#define PS_STAGES 6
#endif
#ifndef PS_SL
#define PS_SL 7  // chunk steps (256 elements each) per K-slice of down's input
#endif
#ifndef PS_SR
#define PS_SR 1  // tokens per round of staging loads (2: spills)
#endif
#ifndef PS_FENCE
#define PS_FENCE 0  // 1: also a membar.gl before the release store and after the acquire loads
#endif
#ifndef PS_TM
#define PS_TM 8  // tokens per tile (at most M)
#endif
#define PS_D 4096
#define PS_F 14336
#define PS_HD 128
#define PS_HKV 8
#define PS_QKV (PS_D + 2 * PS_HKV * PS_HD)

struct PsArgs {
    const unsigned short* const* mats;  // per layer: Wqkv [6144, D], Wo [D, D], Wgu [2F, D], Wd [D, F]; then head
    const float* attn_norm;             // [layers, D]
    const float* ffn_norm;              // [layers, D]
    const float* out_norm;              // [D]
    const float* h0;                    // [M, D] the embedding rows (layer 0's input)
    float* h;                           // [M, D] residual stream: the last layer's output out
    float* h1;                          // [M, D] residual after attention
    float* q;                           // [M, D] queries after RoPE
    float* att;                         // [M, D] attention output
    float* act;                         // [M, F] SiLU gate output
    float* kc;                          // [layers, M, HKV, P, HD]: token m's sequence
    float* vc;                          // [layers, M, HKV, P, HD]
    const int* pos;                     // [M] positions (< SPLIT_KV)
    const float* cosr;                  // [M, HD / 2] the RoPE table's rows at pos
    const float* sinr;                  // [M, HD / 2]
    float* logits;                      // [M, vocab]
    unsigned int* flags;                // [grid] barrier flags
    unsigned long long* times;          // [5 * layers + 2] block 0's %globaltimer: start, after each barrier, end
    int layers, M, P, vocab;
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

// Lane-major position (V = 8) of element i of a row of K elements.
template <int K>
__device__ __forceinline__ int ps_lm(int i) {
    constexpr int g = K >> 5;
    int l = i / g, r = i - l * g;
    return ((r >> 3) * 32 + l) * 8 + (r & 7);
}

// x [M, D] (written by other blocks) into xs [M, D] in lane-major order; with
// w: RMSNorm of each token (node/reference.py rms_norm) applied in place.
// Loads of PS_SR tokens at a time are in flight together, the norm weights' with the first.
template <bool NORM>
__device__ __noinline__ void ps_stage(float* xs, float* red, const float* x, const float* w, float eps, int M) {
    constexpr int K = PS_D, g = K >> 5, T = 32 * PS_WARPS, N = K / 4 / T;
    static_assert(K % (4 * T) == 0 && g % 8 == 0, "float4 units, lane chunks of 8");
    float4 wv[N];
    if (NORM)
#pragma unroll
        for (int u = 0; u < N; ++u) wv[u] = __ldg((const float4*)w + threadIdx.x + u * T);
    for (int t0 = 0; t0 < M; t0 += PS_SR) {
        float4 v[PS_SR][N];
#pragma unroll
        for (int tt = 0; tt < PS_SR; ++tt)
#pragma unroll
            for (int u = 0; u < N; ++u)
                if (t0 + tt < M) v[tt][u] = __ldcg((const float4*)(x + (size_t)(t0 + tt) * K) + threadIdx.x + u * T);
#pragma unroll
        for (int tt = 0; tt < PS_SR; ++tt)
#pragma unroll
            for (int u = 0; u < N; ++u)
                if (t0 + tt < M) *(float4*)(xs + (t0 + tt) * K + ps_lm<K>(4 * (threadIdx.x + u * T))) = v[tt][u];
    }
    __syncthreads();
    if (!NORM) return;
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    for (int t = wi; t < M; t += PS_WARPS) {  // token t's sum of squares: lane order, then the butterfly
        float acc = 0.0f;
        for (int j = 0; j < (g >> 3); ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float xv = xs[t * K + (j * 32 + lane) * 8 + e];
                acc = __fadd_rn(acc, __fmul_rn(xv, xv));
            }
        acc = bx_butterfly(acc);
        if (lane == 0) red[t] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, (float)K), eps)));
    }
    __syncthreads();
    for (int t = 0; t < M; ++t) {
        float inv = red[t];
#pragma unroll
        for (int u = 0; u < N; ++u) {
            float4* p = (float4*)(xs + t * K + ps_lm<K>(4 * (threadIdx.x + u * T)));
            float4 o = *p;
            o.x = __fmul_rn(__fmul_rn(o.x, inv), wv[u].x);
            o.y = __fmul_rn(__fmul_rn(o.y, inv), wv[u].y);
            o.z = __fmul_rn(__fmul_rn(o.z, inv), wv[u].z);
            o.w = __fmul_rn(__fmul_rn(o.w, inv), wv[u].w);
            *p = o;
        }
    }
    __syncthreads();
}

// cp.async copies of down's input slice s for M tokens into buf (one commit
// group): slice s holds the lane-major positions s * PS_SL * 256 .. of each
// token's F elements, token t at buf + t * PS_SL * 256.
constexpr int PS_SU = PS_SL * 64;  // float4 units per token and slice
__device__ __forceinline__ void ps_slice_copy(float* buf, const float* act, int s, int M) {
    for (int u = threadIdx.x; u < M * PS_SU; u += 32 * PS_WARPS) {
        int t = u / PS_SU, q = s * PS_SL * 256 + (u - t * PS_SU) * 4;
        int j = q >> 8, l = (q >> 3) & 31, e = q & 7;  // q = (j * 32 + l) * 8 + e
        unsigned int dst = (unsigned int)__cvta_generic_to_shared(buf + t * PS_SL * 256 + (u - t * PS_SU) * 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                     "l"(act + (size_t)t * PS_F + l * (PS_F >> 5) + j * 8 + e));
    }
    asm volatile("cp.async.commit_group;");
}

// Decode attention of token m at its position (one split: pos < SPLIT_KV)
// for the PS_G = 32 / HKV query heads that share KV head kvh (GQA; each key
// and value loaded once for the group), output dimensions 32 dq .. 32 dq + 31;
// node/reference.py attention for every head; run by one block.
#define PS_G (32 / PS_HKV)
__device__ __noinline__ void ps_attention(const PsArgs& a, int layer, int m, int kvh, int dq, float* sm) {
    float* s = sm;                       // [PS_G][SPLIT_KV] scores, then exp terms
    float* part = s + PS_G * SPLIT_KV;   // [PS_G][32][32] lane partials of the block's 32 output dims
    float* red = part + PS_G * 32 * 32;  // [PS_WARPS][PS_G], then the PS_G exp sums
    int L = a.pos[m] + 1, t = threadIdx.x, lane = t & 31, wi = t >> 5;
    size_t base = ((size_t)((layer * a.M + m) * PS_HKV + kvh) * a.P) * PS_HD;
    const float* kb = a.kc + base;
    const float* vb = a.vc + base;
    float4 q4[PS_G];
#pragma unroll
    for (int i = 0; i < PS_G; ++i)
        q4[i] = __ldcg((const float4*)(a.q + (size_t)m * PS_D + (kvh * PS_G + i) * PS_HD) + lane);
    constexpr int SW = SPLIT_KV / PS_WARPS / 2;
    float mx[PS_G];
#pragma unroll
    for (int i = 0; i < PS_G; ++i) mx[i] = -__int_as_float(0x7f800000);
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
            if (slot < L) {
#pragma unroll
                for (int i = 0; i < PS_G; ++i) {
                    float acc = 0.0f;
                    acc = __fadd_rn(acc, __fmul_rn(q4[i].x, k4[k].x));
                    acc = __fadd_rn(acc, __fmul_rn(q4[i].y, k4[k].y));
                    acc = __fadd_rn(acc, __fmul_rn(q4[i].z, k4[k].z));
                    acc = __fadd_rn(acc, __fmul_rn(q4[i].w, k4[k].w));
                    float sc = __fmul_rn(bx_butterfly(acc), a.scale);
                    if (lane == 0) s[i * SPLIT_KV + slot] = sc;
                    mx[i] = fmaxf(mx[i], sc);
                }
            }
        }
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < PS_G; ++i) red[wi * PS_G + i] = mx[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PS_G; ++i) {
        mx[i] = red[i];
        for (int w = 1; w < PS_WARPS; ++w) mx[i] = fmaxf(mx[i], red[w * PS_G + i]);
    }
    for (int i = t; i < PS_G * SPLIT_KV; i += blockDim.x) {
        int h = i / SPLIT_KV, slot = i - h * SPLIT_KV;
        float mh = mx[0];
#pragma unroll
        for (int g = 1; g < PS_G; ++g)
            if (h == g) mh = mx[g];
        if (slot < L) s[i] = bx_exp32(__fsub_rn(s[i], mh));
    }
    __syncthreads();
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
#pragma unroll
            for (int h = 0; h < PS_G; ++h) {
                float acc = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (8 * c + k < L) acc = __fadd_rn(acc, __fmul_rn(s[h * SPLIT_KV + 8 * c + k], vv[u][k]));
                part[h * 1024 + i] = acc;
            }
        }
    }
    if (wi < PS_G) {  // head wi's exp sum: lane owns slots 8 lane .. 8 lane + 7
        float acc = 0.0f;
        for (int k = 0; k < 8; ++k)
            if (8 * lane + k < L) acc = __fadd_rn(acc, s[wi * SPLIT_KV + 8 * lane + k]);
        acc = bx_butterfly(acc);
        if (lane == 0) red[PS_WARPS * PS_G + wi] = acc;
    }
    __syncthreads();
    if (t < 32 * PS_G) {
        int h = t >> 5, d = t & 31;
        float p[32];
#pragma unroll
        for (int c = 0; c < 32; ++c) p[c] = part[h * 1024 + c * 32 + d];
        float o = bx_tree<32>(p);
        float mh = mx[0];
#pragma unroll
        for (int g = 1; g < PS_G; ++g)
            if (h == g) mh = mx[g];
        float w = bx_exp32(__fsub_rn(mh, mh));  // the one split's weight against the maximum over splits
        float big_l = __fadd_rn(0.0f, __fmul_rn(red[PS_WARPS * PS_G + h], w));
        float big_o = __fadd_rn(0.0f, __fmul_rn(o, w));
        a.att[(size_t)m * PS_D + (kvh * PS_G + h) * PS_HD + 32 * dq + d] = __fdiv_rn(big_o, big_l);
    }
    __syncthreads();
}

// Token t's value of a per-token array held in registers (t is a lane index).
__device__ __forceinline__ float ps_pick(const float (&v)[PS_TM], int t) {
    float r = 0.0f;
#pragma unroll
    for (int i = 0; i < PS_TM; ++i)
        if (t == i) r = v[i];
    return r;
}

extern "C" __global__ void __launch_bounds__(32 * PS_WARPS, 1) probe_step(unsigned int epoch0) {
    const PsArgs& a = ps_args;
    extern __shared__ __align__(16) unsigned char smem[];
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, M = a.M;
    int nwg = gridDim.x * PS_WARPS, gw = wi * gridDim.x + blockIdx.x;  // pairs spread over blocks first
    unsigned char* ring = smem + wi * PS_STAGES * 1024;
    float* xs = (float*)(smem + PS_WARPS * PS_STAGES * 1024);      // [PS_TM, D]; down: two slice buffers
    float* red = xs + PS_TM * PS_D;
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
    // One chunk step of the contract's sums of two rows for M tokens: the
    // ring's next chunk times x's 8 elements at xc (token t at xc + t * xstride).
    auto chunk = [&](const float* xc, int xstride, float (&a0)[PS_TM], float (&a1)[PS_TM]) {
        issue();
        asm volatile("cp.async.wait_group %0;" ::"n"(PS_STAGES - 1) : "memory");
        uint4 wa = *(const uint4*)(ring + cs * 1024 + lane * 16);
        uint4 wb = *(const uint4*)(ring + cs * 1024 + 512 + lane * 16);
        cs = cs + 1 == PS_STAGES ? 0 : cs + 1;
        unsigned int ua[4] = {wa.x, wa.y, wa.z, wa.w}, ub[4] = {wb.x, wb.y, wb.z, wb.w};
        float w0[8], w1[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w0[2 * i] = bx_bf16((unsigned short)(ua[i] & 0xFFFFu));
            w0[2 * i + 1] = bx_bf16((unsigned short)(ua[i] >> 16));
            w1[2 * i] = bx_bf16((unsigned short)(ub[i] & 0xFFFFu));
            w1[2 * i + 1] = bx_bf16((unsigned short)(ub[i] >> 16));
        }
#pragma unroll
        for (int t = 0; t < PS_TM; ++t) {
            if (t >= M) break;
            const float4* x4 = (const float4*)(xc + t * xstride);
            float4 xa = x4[0], xb = x4[1];
            float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                a0[t] = __fadd_rn(a0[t], __fmul_rn(xv[i], w0[i]));
                a1[t] = __fadd_rn(a1[t], __fmul_rn(xv[i], w1[i]));
            }
        }
    };
    // Two rows against xs (K = D): all chunk steps, then the butterflies; lane t < M gets token t's sums.
    auto rows2 = [&](float& y0, float& y1) {
        float a0[PS_TM], a1[PS_TM];
#pragma unroll
        for (int t = 0; t < PS_TM; ++t) a0[t] = a1[t] = 0.0f;
        for (int j = 0; j < (PS_D >> 8); ++j) chunk(xs + (j * 32 + lane) * 8, PS_D, a0, a1);
#pragma unroll
        for (int t = 0; t < PS_TM; ++t)
            if (t < M) {
                a0[t] = bx_butterfly(a0[t]);
                a1[t] = bx_butterfly(a1[t]);
            }
        y0 = ps_pick(a0, lane);
        y1 = ps_pick(a1, lane);
    };
    ps_time(a, 0);
    for (int i = 0; i < PS_STAGES - 1; ++i) issue();

    for (int layer = 0; layer < a.layers; ++layer) {
        // Q/K/V: RoPE on adjacent pairs, K and V into the cache at each token's position
        const float* hin = layer == 0 ? a.h0 : a.h;
        if (layer > 0) { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        {  // this layer's cached keys and values (positions < pos) into L2 for the attention phase
            size_t lines = (size_t)M * PS_HKV * a.P * PS_HD * 4 / 128;
            for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * lines;
                 i += (size_t)gridDim.x * blockDim.x) {
                size_t li = i % lines;
                int m = (int)(li / ((size_t)PS_HKV * a.P * PS_HD / 32));
                if ((int)((li * 32 / PS_HD) % a.P) < a.pos[m])
                    bx_prefetch_l2((i < lines ? a.kc : a.vc) + (size_t)layer * M * PS_HKV * a.P * PS_HD + li * 32);
            }
        }
        ps_stage<true>(xs, red, hin, a.attn_norm + (size_t)layer * PS_D, a.eps, M);
        for (int p = gw; p < PS_QKV / 2; p += nwg) {
            float y0, y1;
            int r = 2 * p, i = (r % PS_HD) >> 1, tl = min(lane, M - 1);
            float c = __ldg(a.cosr + tl * (PS_HD / 2) + i), s = __ldg(a.sinr + tl * (PS_HD / 2) + i);
            int pos = __ldg(a.pos + tl);
            rows2(y0, y1);
            if (lane < M) {
                if (r < PS_D + PS_HKV * PS_HD) {
                    float o0 = __fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, s));
                    float o1 = __fadd_rn(__fmul_rn(y0, s), __fmul_rn(y1, c));
                    float* dst = r < PS_D ? a.q + (size_t)lane * PS_D + r
                                          : a.kc + ((size_t)((layer * M + lane) * PS_HKV + (r - PS_D) / PS_HD) * a.P +
                                                    pos) * PS_HD + (r - PS_D) % PS_HD;
                    dst[0] = o0;
                    dst[1] = o1;
                } else {
                    int rv = r - PS_D - PS_HKV * PS_HD;
                    float* dst = a.vc + ((size_t)((layer * M + lane) * PS_HKV + rv / PS_HD) * a.P + pos) * PS_HD +
                                 rv % PS_HD;
                    dst[0] = y0;
                    dst[1] = y1;
                }
            }
        }
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        for (int task = blockIdx.x; task < M * PS_HKV * 4; task += gridDim.x)
            ps_attention(a, layer, task / (PS_HKV * 4), (task >> 2) % PS_HKV, task & 3, xs);
        // O and the residual
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        ps_stage<false>(xs, red, a.att, nullptr, 0.0f, M);
        for (int p = gw; p < PS_D / 2; p += nwg) {
            float y0, y1;
            const float* rp = hin + (size_t)min(lane, M - 1) * PS_D + 2 * p;
            float r0 = __ldcg(rp), r1 = __ldcg(rp + 1);
            rows2(y0, y1);
            if (lane < M) {
                a.h1[(size_t)lane * PS_D + 2 * p] = __fadd_rn(r0, y0);
                a.h1[(size_t)lane * PS_D + 2 * p + 1] = __fadd_rn(r1, y1);
            }
        }
        // gate/up and the SiLU gate
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        ps_stage<true>(xs, red, a.h1, a.ffn_norm + (size_t)layer * PS_D, a.eps, M);
        for (int p = gw; p < PS_F; p += nwg) {
            float g, u;
            rows2(g, u);
            if (lane < M) a.act[(size_t)lane * PS_F + p] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, bx_exp32(-g))), u);
        }
        // down and the residual: x in K-slices, every warp of the block in step
        { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
        for (int p0 = 0; p0 < PS_D / 2; p0 += nwg) {
            int p = p0 + gw;
            bool live = p < PS_D / 2;
            const float* rp = a.h1 + (size_t)min(lane, M - 1) * PS_D + 2 * min(p, PS_D / 2 - 1);
            float r0 = __ldcg(rp), r1 = __ldcg(rp + 1);
            float a0[PS_TM], a1[PS_TM];
#pragma unroll
            for (int t = 0; t < PS_TM; ++t) a0[t] = a1[t] = 0.0f;
            constexpr int NS = (PS_F >> 8) / PS_SL, BUF = PS_TM * PS_SL * 256;
            static_assert((PS_F >> 8) % PS_SL == 0 && 2 * BUF <= PS_TM * PS_D, "whole slices, two buffers in xs");
            // Slice s + 1 is copied while slice s is added. A live warp's wait for it leaves the
            // PS_SL newest groups (its chunks) pending: with PS_SL >= PS_STAGES - 1 the ring keeps its depth.
            ps_slice_copy(xs, a.act, 0, M);
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();
            for (int s = 0; s < NS; ++s) {
                if (s + 1 < NS) ps_slice_copy(xs + ((s + 1) & 1) * BUF, a.act, s + 1, M);
                if (live)
                    for (int jj = 0; jj < PS_SL; ++jj)
                        chunk(xs + (s & 1) * BUF + (jj * 32 + lane) * 8, PS_SL * 256, a0, a1);
                if (s + 1 < NS) {
                    if (live) asm volatile("cp.async.wait_group %0;" ::"n"(PS_SL) : "memory");
                    else asm volatile("cp.async.wait_group 0;" ::: "memory");
                }
                __syncthreads();
            }
            if (live) {
#pragma unroll
                for (int t = 0; t < PS_TM; ++t)
                    if (t < M) {
                        a0[t] = bx_butterfly(a0[t]);
                        a1[t] = bx_butterfly(a1[t]);
                    }
                float y0 = ps_pick(a0, lane), y1 = ps_pick(a1, lane);
                if (lane < M) {
                    a.h[(size_t)lane * PS_D + 2 * p] = __fadd_rn(r0, y0);
                    a.h[(size_t)lane * PS_D + 2 * p + 1] = __fadd_rn(r1, y1);
                }
            }
        }
    }
    { ps_barrier(a.flags, ++e); ps_time(a, e - epoch0); }
    ps_stage<true>(xs, red, a.h, a.out_norm, a.eps, M);
    for (int p = gw; p < a.vocab / 2; p += nwg) {
        float y0, y1;
        rows2(y0, y1);
        if (lane < M) {
            a.logits[(size_t)lane * a.vocab + 2 * p] = y0;
            a.logits[(size_t)lane * a.vocab + 2 * p + 1] = y1;
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    ps_time(a, e - epoch0 + 1);
}
