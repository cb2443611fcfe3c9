// bitexact: a whole forward step of a llama model with F16 or BF16 weights
// in one cooperative launch (docs/determinism.md section 13). For every
// token of the step, in tiles of ST_TM tokens: each layer's RMSNorms, Q/K/V
// with RoPE and the KV store, split-KV attention over the paged KV cache,
// O with its residual, gate/up with the SiLU gate, down with its residual;
// then the final RMSNorm and the LM head of the wanted rows. Every sum is
// the contract's (twins in node/reference.py: rms_norm, matmul_f, rope,
// attention, silu_gate, residual_add), so the bytes equal the per-op kernels'
// and the numpy engine's.
//
// The model's dimensions are compiled in (-D ST_D, ST_F, ST_HD, ST_H, ST_HKV,
// ST_WT; node/backend_cuda.py step_defines); nothing depends on the number
// of tokens, rows, sequences or KV length but how many tiles, splits and
// tasks run. Phases are separated by a grid barrier without atomics: each
// block stores the barrier's number into its own flag (st.release) and polls
// every block's flag (ld.acquire); every block passes the same barriers, so
// all flags are equal between launches and a launch counts on from them.
// Each warp computes pairs of rows (a RoPE pair, a gate row and its up row,
// or two adjacent rows) and streams their weights (lane-major, V = 8:
// node/reference.py lane_major) with cp.async through a ring of ST_STAGES
// stages of 1 KB in shared memory; the ring runs on across phases, layers
// and tiles (weights never depend on a barrier); each chunk of weights is
// added to every token of the tile. A phase's input is staged per block in
// shared memory by chunk step and lane (st_xpos), normalised there for RMSNorm
// phases; down's input is copied with cp.async in K-slices of ST_SL chunk
// steps into two buffers.
// Attention: HD/32 blocks per KV head and token, each computing every score
// of the KV head's query heads (one warp per slot) and 32 output dimensions;
// per split its max, exp sum and output go to global scratch, then the
// splits are combined in order. Launcher: node/backend_cuda.py launch_step.
#include "common.cuh"

#ifndef ST_D  // the Llama-3.1-8B shape in BF16 (the node compiles each model's own)
#define ST_D 4096
#define ST_F 14336
#define ST_HD 128
#define ST_H 32
#define ST_HKV 8
#define ST_WT BX_BF16
#endif
#ifndef ST_TIMES
#define ST_TIMES 0  // 1: block 0 records %globaltimer into times (scripts/profile_step.py --one-launch)
#endif
#define ST_WARPS 16
#ifndef ST_STAGES
#define ST_STAGES 6  // ring stages per warp (a measurement may set another: scripts/profile_step.py --variant)
#endif
#define ST_TM 8  // tokens per tile
#define ST_QKV ((ST_H + 2 * ST_HKV) * ST_HD)
#define ST_G (ST_H / ST_HKV)  // query heads per KV head
#define ST_QE (ST_HD / 32)    // head elements per lane in a score
#define ST_DQ (ST_HD / 32)    // blocks per KV head and token (32 output dimensions each)
#define ST_OREC 34  // floats per split, head and block: max, exp sum, 32 output dimensions

static_assert(ST_H * ST_HD == ST_D && ST_D % 256 == 0 && ST_F % 256 == 0, "V = 8 lane chunks of D and F");
static_assert(ST_HD % 32 == 0 && ST_HD <= 128 && ST_H % ST_HKV == 0 && ST_G <= ST_WARPS, "heads");
// a lane holds ST_G * ST_QE values of q in st_attention: more spills registers (ptxas -v)
static_assert(ST_G * ST_QE <= 32, "heads: query values per lane");
static_assert(ST_WT == BX_F16 || ST_WT == BX_BF16, "2-byte float weights");

// Down's K-slice: the largest number of chunk steps <= 7 that divides F / 256.
__host__ __device__ constexpr int st_slice() {
    int s = 7;
    while ((ST_F / 256) % s) --s;
    return s;
}
constexpr int ST_SL = st_slice();
__host__ __device__ constexpr int st_max(int a, int b) { return a > b ? a : b; }
// Floats of the staging area: a tile's inputs, down's two slice buffers, or attention's scratch.
constexpr int ST_XS = st_max(st_max(ST_TM * ST_D, 2 * ST_TM * ST_SL * 256), ST_G * (256 + 1024) + ST_WARPS * ST_G + ST_G);
extern "C" __constant__ int bx_step_smem = ST_WARPS * ST_STAGES * 1024 + (ST_XS + 32) * 4;
#define ST_STATIC 1024  // bytes of shared memory before the rings: the static variables, padded (st_smem)
static_assert(ST_STATIC + ST_WARPS * ST_STAGES * 1024 + (ST_XS + 32) * 4 <= 227 * 1024,
              "shared memory of sm_90 (the static variables padded, then the dynamic area)");

struct StepArgs {
    const unsigned short* const* mats;  // per layer: q, k, v, o, gate, up, down; then the LM head
    const float* const* norms;          // per layer: attn_norm, ffn_norm; then output_norm
    const float* h0;                    // [M, D] embedding rows
    float* h;                           // [M, D] residual stream (the last layer's output)
    float* h1;                          // [TM, D] the tile's residual after attention
    float* q;                           // [TM, D] the tile's queries after RoPE
    float* att;                         // [TM, D] the tile's attention output
    float* act;                         // [TM, F] the tile's SiLU gate output
    float* kc;                          // [layers, pages, HKV, 256, HD]
    float* vc;
    const int* page_tab;                // [M, ms] page of each split of the token's sequence
    const int* qpos;                    // [M] positions
    const float* cosr;                  // [n_ctx, HD / 2] the RoPE table
    const float* sinr;
    const long long* rows;              // [R] tokens whose logits are wanted
    float* scratch;                     // [TM, HKV, DQ, ms, G, OREC] per-split attention results
    float* logits;                      // [R, vocab]
    unsigned int* flags;                // [grid] barrier flags
    unsigned long long* times;          // ST_TIMES builds: the start, after the launch's barrier k at k, the end
    int layers, M, R, ms, pages, vocab;
    float eps, scale;
};
extern "C" __constant__ int bx_step_args_bytes = sizeof(StepArgs);

// The launch's arguments, copied into shared memory at the start (every function reads them there).
__shared__ StepArgs st_a;

// A warp's place in its sequence of weight chunks (weight phase w: tile w / (4 layers), layer
// w / 4 % layers, product w % 4; from 4 layers tiles on, the LM head's row tiles; pair p, chunk
// step j), the pair's rows, and its ring's producer stage: kept here between phases. The ring
// runs ST_STAGES - 1 chunks ahead, so the chunk consumed after an issue is in the stage the issue
// moved ps to.
struct StWarp {
    const unsigned char *r0, *r1;  // pair p's two rows (st_rows, once per pair)
    int k, w, p, j, ps;            // k: the rows' length; ps: the stage the next issue fills
};
__shared__ StWarp st_warp[ST_WARPS];
__shared__ int st_lim[2];  // the first LM-head weight phase, the end of the weight phases
// The (tile, layer) being computed, and the flags' value at the launch's start: the kernel keeps
// no value in registers across its calls of the phases (each phase uses every register), so
// nothing spills.
__shared__ int st_it;
__shared__ unsigned int st_e0;
static_assert(sizeof(StepArgs) + ST_WARPS * sizeof(StWarp) + 4 * sizeof(int) <= ST_STATIC,
              "the static variables fit the space the shared-memory budget counts before the rings");
// The rings, then the staging area. The rings start at a 1 KB boundary (each stage is 1 KB): 528
// bytes in (after the static variables) the 4-layer 8B BF16 step took 0.971 ms at batch 1 instead
// of 0.783 (docs/benchmarks.md, twenty-fifth session).
extern __shared__ __align__(ST_STATIC) unsigned char st_smem[];

// The staging area, after the rings (ST_XS floats, then 32 for the norms' factors).
__device__ __forceinline__ float* st_xs() { return (float*)(st_smem + ST_WARPS * ST_STAGES * 1024); }

__device__ __forceinline__ float st_w(unsigned short u) {
    return ST_WT == BX_BF16 ? bx_bf16(u) : bx_half(u);
}

// ST_TIMES builds: block 0's %globaltimer (ns) into times[i].
__device__ __forceinline__ void st_time(int i) {
    if (ST_TIMES && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        st_a.times[i] = t;
    }
}

__device__ __forceinline__ void st_barrier(unsigned int* flags, unsigned int e) {
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(e) : "memory");
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        unsigned int v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + b) : "memory");
        } while ((int)(v - e) < 0);
    }
    __syncthreads();
    st_time(e - st_e0);
}

// Barrier j (1 .. 5: before Q/K/V, attention, O, gate/up, down) of (tile, layer) st_it, numbered
// st_e0 + 5 st_it + j (the first Q/K/V has none); after the last (tile, layer), j = 1: the LM head's.
__device__ __forceinline__ void st_sync(int j) { st_barrier(st_a.flags, st_e0 + 5 * st_it + j); }

// Staged inputs in shared memory: element e (0 .. 7) of lane l's chunk step j of a row sits at
// st_xpos(j, l, e): per chunk step the 32 lanes' first four elements, then their last four, so
// each of a warp's two 16-byte loads of a chunk step reads 512 contiguous bytes (a quarter-warp
// 128 bytes: no bank conflict; lane-major V = 8 with each lane's 32 bytes side by side gave two).
__host__ __device__ constexpr int st_xpos(int j, int l, int e) { return j * 256 + (e >> 2) * 128 + l * 4 + (e & 3); }

// The staged position of element i of a row of K elements (lane l = i / (K / 32) owns the
// contract's elements l K / 32 ..; node/reference.py lane_major).
template <int K>
__host__ __device__ constexpr int st_lm(int i) {
    constexpr int g = K >> 5;
    int l = i / g, r = i - l * g;
    return st_xpos(r >> 3, l, r & 7);
}

// st_lm is a bijection of [0, K) (its inverse checked at every position) that keeps each
// 4-aligned group of 4 elements contiguous (float4 stores).
template <int K>
__host__ __device__ constexpr bool st_layout_ok() {
    constexpr int g = K >> 5;
    for (int i = 0; i < K; ++i) {
        int q = st_lm<K>(i), j = q >> 8, e = ((q >> 7) & 1) * 4 + (q & 3), l = (q >> 2) & 31;
        if (q < 0 || q >= K || l * g + j * 8 + e != i || (i % 4 && q != st_lm<K>(i - 1) + 1)) return false;
    }
    return true;
}
static_assert(st_layout_ok<ST_D>() && st_layout_ok<ST_F>(), "staging layout");

// The rows of a weight phase: product m (0 Q/K/V, 1 O, 2 gate/up, 3 down, 4 LM head).
__device__ __forceinline__ int st_pairs(int m, int vocab) {
    return m == 0 ? ST_QKV / 2 : m == 1 ? ST_D / 2 : m == 2 ? ST_F : m == 3 ? ST_D / 2 : (vocab + 1) / 2;
}
__device__ __forceinline__ int st_k(int m) { return m == 3 ? ST_F : ST_D; }

// The two rows of pair p of weight phase w; returns their K.
__device__ __forceinline__ int st_rows(int w, int p, const unsigned char*& b0, const unsigned char*& b1) {
    const StepArgs& a = st_a;
    int m = w >= st_lim[0] ? 4 : w & 3, k = st_k(m);
    const unsigned short* const* mt = a.mats + 7 * (w >= st_lim[0] ? a.layers : (w >> 2) % a.layers);
    const unsigned short *r0, *r1;
    if (m == 0) {
        int r = 2 * p, i = r < ST_D ? 0 : r < ST_D + ST_HKV * ST_HD ? 1 : 2;
        r0 = mt[i] + (size_t)(r - (i == 0 ? 0 : i == 1 ? ST_D : ST_D + ST_HKV * ST_HD)) * k;
        r1 = r0 + k;
    } else if (m == 2) {
        r0 = mt[4] + (size_t)p * k;
        r1 = mt[5] + (size_t)p * k;
    } else {
        const unsigned short* base = mt[m == 4 ? 0 : m == 1 ? 3 : 6];
        r0 = base + (size_t)2 * p * k;
        r1 = base + (size_t)min(2 * p + 1, (m == 4 ? a.vocab : ST_D) - 1) * k;
    }
    b0 = (const unsigned char*)r0;
    b1 = (const unsigned char*)r1;
    return k;
}

// Skip to the next weight phase that has pair p for this warp; find the pair's rows.
__device__ __forceinline__ void st_skip(StWarp& c, int gw) {
    while (c.w < st_lim[1] && c.p >= st_pairs(c.w >= st_lim[0] ? 4 : c.w & 3, st_a.vocab)) {
        ++c.w;
        c.p = gw;
    }
    if (c.w < st_lim[1]) c.k = st_rows(c.w, c.p, c.r0, c.r1);
}

// The warp's next weight chunk (two rows' 256 elements) into its ring, one commit group.
__device__ __forceinline__ void st_issue(StWarp& s) {
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    if (s.w < st_lim[1]) {
        size_t off = (size_t)(s.j * 32 + lane) * 16;
        unsigned int dst = (unsigned int)__cvta_generic_to_shared(st_smem + (wi * ST_STAGES + s.ps) * 1024 + lane * 16);
        // "memory": the copy overwrites the stage this lane read last (no read may move past it)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(s.r0 + off) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 512), "l"(s.r1 + off) : "memory");
        if (++s.j == (s.k >> 8)) {
            s.j = 0;
            s.p += gridDim.x * ST_WARPS;
            st_skip(s, wi * gridDim.x + blockIdx.x);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    s.ps = s.ps + 1 == ST_STAGES ? 0 : s.ps + 1;
}

// One chunk step of the contract's sums of two rows for n tokens: the ring's next chunk
// times x's 8 elements at xc = st_xpos(j, lane, 0) of the staged rows (token t at xc + t *
// xstride); issues the chunk ST_STAGES - 1 ahead.
__device__ __forceinline__ void st_chunk(StWarp& s, const float* xc, int xstride, int n, float (&a0)[ST_TM],
                                         float (&a1)[ST_TM]) {
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    st_issue(s);
    asm volatile("cp.async.wait_group %0;" ::"n"(ST_STAGES - 1) : "memory");
    const unsigned char* st = st_smem + (wi * ST_STAGES + s.ps) * 1024 + lane * 16;
    uint4 wa = *(const uint4*)st;
    uint4 wb = *(const uint4*)(st + 512);
    unsigned int ua[4] = {wa.x, wa.y, wa.z, wa.w}, ub[4] = {wb.x, wb.y, wb.z, wb.w};
    float w0[8], w1[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w0[2 * i] = st_w((unsigned short)(ua[i] & 0xFFFFu));
        w0[2 * i + 1] = st_w((unsigned short)(ua[i] >> 16));
        w1[2 * i] = st_w((unsigned short)(ub[i] & 0xFFFFu));
        w1[2 * i + 1] = st_w((unsigned short)(ub[i] >> 16));
    }
#pragma unroll
    for (int t = 0; t < ST_TM; ++t) {
        if (t >= n) break;
        const float4* x4 = (const float4*)(xc + t * xstride);
        float4 xa = x4[0], xb = x4[32];  // st_xpos: elements 4 .. 7 are 128 floats on
        float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            a0[t] = __fadd_rn(a0[t], __fmul_rn(xv[i], w0[i]));
            a1[t] = __fadd_rn(a1[t], __fmul_rn(xv[i], w1[i]));
        }
    }
}

// Token t's value of a per-token array held in registers (t is a lane index).
__device__ __forceinline__ float st_pick(const float (&v)[ST_TM], int t) {
    float r = 0.0f;
#pragma unroll
    for (int i = 0; i < ST_TM; ++i)
        if (t == i) r = v[i];
    return r;
}

// The butterflies of two rows' lane sums for n tokens; lane t < n gets token t's sums.
__device__ __forceinline__ void st_finish(float (&a0)[ST_TM], float (&a1)[ST_TM], int n, float& y0, float& y1) {
#pragma unroll
    for (int t = 0; t < ST_TM; ++t)
        if (t < n) {
            a0[t] = bx_butterfly(a0[t]);
            a1[t] = bx_butterfly(a1[t]);
        }
    y0 = st_pick(a0, threadIdx.x & 31);
    y1 = st_pick(a1, threadIdx.x & 31);
}

// Two rows against the staged inputs (K = D) for n tokens.
__device__ __forceinline__ void st_rows2(StWarp& s, int n, float& y0, float& y1) {
    const float* xs = st_xs();
    float a0[ST_TM], a1[ST_TM];
#pragma unroll
    for (int t = 0; t < ST_TM; ++t) a0[t] = a1[t] = 0.0f;
    for (int j = 0; j < (ST_D >> 8); ++j) st_chunk(s, xs + st_xpos(j, threadIdx.x & 31, 0), ST_D, n, a0, a1);
    st_finish(a0, a1, n, y0, y1);
}

// The warp's state from shared memory, and back.
__device__ __forceinline__ StWarp st_load_warp() { return st_warp[threadIdx.x >> 5]; }
__device__ __forceinline__ void st_store_warp(const StWarp& s) {
    if ((threadIdx.x & 31) == 0) st_warp[threadIdx.x >> 5] = s;
    __syncwarp();
}

// Rows row0 .. row0 + n - 1 of x [., D] (rows[] maps them when given; written by other
// blocks) into xs [TM, D] lane-major; with NORM: RMSNorm of each (node/reference.py rms_norm).
template <bool NORM>
__device__ __noinline__ void st_stage(float* xs, float* red, const float* x, const long long* rows, int row0, int n,
                                      const float* w, float eps) {
    constexpr int K = ST_D, g = K >> 5, T = 32 * ST_WARPS, U = K / 4;
    for (int t = 0; t < n; ++t) {
        const float4* src = (const float4*)(x + (size_t)(rows ? rows[row0 + t] : row0 + t) * K);
        for (int u = threadIdx.x; u < U; u += T) *(float4*)(xs + t * K + st_lm<K>(4 * u)) = __ldcg(src + u);
    }
    __syncthreads();
    if (!NORM) return;
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    for (int t = wi; t < n; t += ST_WARPS) {  // token t's sum of squares: lane order, then the butterfly
        float acc = 0.0f;
        for (int j = 0; j < (g >> 3); ++j) {
            const float* xc = xs + t * K + st_xpos(j, lane, 0);
            float4 xa = *(const float4*)xc, xb = *(const float4*)(xc + 128);  // elements 0 .. 3, 4 .. 7
            float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = __fadd_rn(acc, __fmul_rn(xv[e], xv[e]));
        }
        acc = bx_butterfly(acc);
        if (lane == 0) red[t] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, (float)K), eps)));
    }
    __syncthreads();
    for (int u = threadIdx.x; u < U; u += T) {
        float4 wv = __ldg((const float4*)w + u);
        for (int t = 0; t < n; ++t) {
            float inv = red[t];
            float4* p = (float4*)(xs + t * K + st_lm<K>(4 * u));
            float4 o = *p;
            o.x = __fmul_rn(__fmul_rn(o.x, inv), wv.x);
            o.y = __fmul_rn(__fmul_rn(o.y, inv), wv.y);
            o.z = __fmul_rn(__fmul_rn(o.z, inv), wv.z);
            o.w = __fmul_rn(__fmul_rn(o.w, inv), wv.w);
            *p = o;
        }
    }
    __syncthreads();
}

// cp.async copies of down's input slice s for n tokens into buf (one commit group):
// slice s holds chunk steps s * SL .. s * SL + SL - 1 of each token's F elements, staged at
// st_xpos(j - s * SL, l, e) (token t at buf + t * SL * 256).
constexpr int ST_SU = ST_SL * 64;  // float4 units per token and slice
__device__ __forceinline__ void st_slice_copy(float* buf, const float* act, int s, int n) {
#pragma unroll 1
    for (int u = threadIdx.x; u < n * ST_SU; u += 32 * ST_WARPS) {
        int t = u / ST_SU, q = (u - t * ST_SU) * 4;
        int j = q >> 8, l = (q >> 3) & 31, e = q & 7;  // unit q of the slice: chunk step j, lane l, elements e ..
        unsigned int dst = (unsigned int)__cvta_generic_to_shared(buf + t * ST_SL * 256 + st_xpos(j, l, e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                     "l"(act + (size_t)t * ST_F + l * (ST_F >> 5) + (s * ST_SL + j) * 8 + e) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// ST_QE consecutive floats from global memory (written by other blocks).
__device__ __forceinline__ void st_load(float (&v)[ST_QE], const float* p) {
    if constexpr (ST_QE == 4) {
        float4 f = __ldcg((const float4*)p);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else if constexpr (ST_QE == 2) {
        float2 f = __ldcg((const float2*)p);
        v[0] = f.x, v[1] = f.y;
    } else {
#pragma unroll
        for (int i = 0; i < ST_QE; ++i) v[i] = __ldcg(p + i);
    }
}

// Attention (node/reference.py attention) of tile token mt (step token m) for the ST_G
// query heads of KV head kvh, output dimensions 32 dq .. 32 dq + 31; run by one block.
// Per split c (positions 256 c ..): scores (a warp per slot: lane l adds q*k over
// d = l*QE .. l*QE + QE - 1, then the butterfly, times scale), the split's max m_c,
// terms exp32(s - m_c), their sum l_c and the output o_c (lane l of the contract owns
// slots 8l .. 8l + 7) into scratch; then the splits in order: w = exp32(m_c - max),
// L += l_c * w, O += o_c * w, out = O / L.
__device__ __forceinline__ void st_attention(int layer, int m, int mt, int kvh, int dq) {
    const StepArgs& a = st_a;
    float* sm = st_xs();
    float* s = sm;                       // [G][256] scores, then exp terms
    float* part = s + ST_G * SPLIT_KV;   // [G][32][32] lane partials of the block's 32 output dims
    float* red = part + ST_G * 32 * 32;  // [WARPS][G] warp maxima, then the G exp sums
    int pos = a.qpos[m], ns = pos / SPLIT_KV + 1, t = threadIdx.x, lane = t & 31, wi = t >> 5;
    float* scr = a.scratch + (size_t)((mt * ST_HKV + kvh) * ST_DQ + dq) * a.ms * (ST_G * ST_OREC);
    float qv[ST_G][ST_QE];
#pragma unroll
    for (int i = 0; i < ST_G; ++i) st_load(qv[i], a.q + (size_t)mt * ST_D + (kvh * ST_G + i) * ST_HD + lane * ST_QE);
    constexpr int SW = SPLIT_KV / ST_WARPS / 2;
    for (int c = 0; c < ns; ++c) {
        int L = c + 1 < ns ? SPLIT_KV : pos - SPLIT_KV * c + 1;
        size_t base = ((size_t)((size_t)layer * a.pages + a.page_tab[(size_t)m * a.ms + c]) * ST_HKV + kvh) *
                      SPLIT_KV * ST_HD;
        const float* kb = a.kc + base;
        const float* vb = a.vc + base;
        float mx[ST_G];
#pragma unroll
        for (int i = 0; i < ST_G; ++i) mx[i] = -__int_as_float(0x7f800000);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float kv[SW][ST_QE];
#pragma unroll
            for (int k = 0; k < SW; ++k) {
                int slot = wi + ST_WARPS * (k + SW * half);
                if (slot < L) st_load(kv[k], kb + (size_t)slot * ST_HD + lane * ST_QE);
            }
#pragma unroll
            for (int k = 0; k < SW; ++k) {
                int slot = wi + ST_WARPS * (k + SW * half);
                if (slot < L) {
#pragma unroll
                    for (int i = 0; i < ST_G; ++i) {
                        float acc = 0.0f;
#pragma unroll
                        for (int e = 0; e < ST_QE; ++e) acc = __fadd_rn(acc, __fmul_rn(qv[i][e], kv[k][e]));
                        float sc = __fmul_rn(bx_butterfly(acc), a.scale);
                        if (lane == 0) s[i * SPLIT_KV + slot] = sc;
                        mx[i] = fmaxf(mx[i], sc);
                    }
                }
            }
        }
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < ST_G; ++i) red[wi * ST_G + i] = mx[i];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ST_G; ++i) {
            mx[i] = red[i];
            for (int w = 1; w < ST_WARPS; ++w) mx[i] = fmaxf(mx[i], red[w * ST_G + i]);
        }
        for (int i = t; i < ST_G * SPLIT_KV; i += blockDim.x) {
            int h = i / SPLIT_KV, slot = i - h * SPLIT_KV;
            float mh = mx[0];
#pragma unroll
            for (int g = 1; g < ST_G; ++g)
                if (h == g) mh = mx[g];
            if (slot < L) s[i] = bx_exp32(__fsub_rn(s[i], mh));
        }
        __syncthreads();
        for (int i0 = t; i0 < 32 * 32; i0 += 2 * blockDim.x) {
            float vv[2][8];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                int i = i0 + u * blockDim.x, cl = i >> 5, d = 32 * dq + (i & 31);
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    vv[u][k] = i < 32 * 32 && 8 * cl + k < L ? __ldcg(vb + (size_t)(8 * cl + k) * ST_HD + d) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                int i = i0 + u * blockDim.x, cl = i >> 5;
                if (i >= 32 * 32) break;
#pragma unroll
                for (int h = 0; h < ST_G; ++h) {
                    float acc = 0.0f;
#pragma unroll
                    for (int k = 0; k < 8; ++k)
                        if (8 * cl + k < L) acc = __fadd_rn(acc, __fmul_rn(s[h * SPLIT_KV + 8 * cl + k], vv[u][k]));
                    part[h * 1024 + i] = acc;
                }
            }
        }
        if (wi < ST_G) {  // head wi's exp sum: lane owns slots 8 lane .. 8 lane + 7
            float acc = 0.0f;
            for (int k = 0; k < 8; ++k)
                if (8 * lane + k < L) acc = __fadd_rn(acc, s[wi * SPLIT_KV + 8 * lane + k]);
            acc = bx_butterfly(acc);
            if (lane == 0) red[ST_WARPS * ST_G + wi] = acc;
        }
        __syncthreads();
        if (t < 32 * ST_G) {
            int h = t >> 5, d = t & 31;
            float p[32];
#pragma unroll
            for (int cl = 0; cl < 32; ++cl) p[cl] = part[h * 1024 + cl * 32 + d];
            float* rec = scr + (c * ST_G + h) * ST_OREC;
            rec[2 + d] = bx_tree<32>(p);
            if (d == 0) {
                float mh = mx[0];
#pragma unroll
                for (int g = 1; g < ST_G; ++g)
                    if (h == g) mh = mx[g];
                rec[0] = mh;
                rec[1] = red[ST_WARPS * ST_G + h];
            }
        }
        __syncthreads();
    }
    if (t < 32 * ST_G) {
        int h = t >> 5, d = t & 31;
        float mall = -__int_as_float(0x7f800000);
        for (int c = 0; c < ns; ++c) mall = fmaxf(mall, scr[(c * ST_G + h) * ST_OREC]);
        float big_l = 0.0f, big_o = 0.0f;
        for (int c = 0; c < ns; ++c) {
            const float* rec = scr + (c * ST_G + h) * ST_OREC;
            float w = bx_exp32(__fsub_rn(rec[0], mall));
            big_l = __fadd_rn(big_l, __fmul_rn(rec[1], w));
            big_o = __fadd_rn(big_o, __fmul_rn(rec[2 + d], w));
        }
        a.att[(size_t)mt * ST_D + (kvh * ST_G + h) * ST_HD + 32 * dq + d] = __fdiv_rn(big_o, big_l);
    }
    __syncthreads();
}

// Q/K/V of tile tokens m0 .. m0 + n - 1 at `layer`: RoPE on adjacent pairs, the queries into
// q, K and V into the cache at each token's slot; first the tokens' cached keys and values
// are hinted into L2 for the attention phase.
__device__ __noinline__ void st_qkv() {
    const StepArgs& a = st_a;
    int it = st_it, layer = it % a.layers, m0 = it / a.layers * ST_TM, n = min(ST_TM, a.M - m0);
    if (it > 0) st_sync(1);
    int lane = threadIdx.x & 31, gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    float* xs = st_xs();
    constexpr int PL = ST_HKV * SPLIT_KV * ST_HD / 32;  // 128-byte lines of a page's keys (or values)
    for (int t = 0; t < n; ++t) {
        int pos = a.qpos[m0 + t];
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (pos / SPLIT_KV + 1) * 2 * PL;
             i += gridDim.x * blockDim.x) {
            int c = i / (2 * PL), half = i / PL & 1, li = i % PL;
            if (SPLIT_KV * c + (li * 32 / ST_HD) % SPLIT_KV < pos)
                bx_prefetch_l2((half ? a.vc : a.kc) +
                               ((size_t)layer * a.pages + a.page_tab[(size_t)(m0 + t) * a.ms + c]) * PL * 32 +
                               (size_t)li * 32);
        }
    }
    st_stage<true>(xs, xs + ST_XS, layer > 0 ? a.h : a.h0, nullptr, m0, n,
                   a.norms[2 * layer], a.eps);
    StWarp s = st_load_warp();
    for (int p = gw; p < ST_QKV / 2; p += gridDim.x * ST_WARPS) {
        float y0, y1;
        int r = 2 * p, i = (r % ST_HD) >> 1, tl = m0 + min(lane, n - 1);
        int pos = __ldg(a.qpos + tl);
        float c = __ldg(a.cosr + (size_t)pos * (ST_HD / 2) + i), sn = __ldg(a.sinr + (size_t)pos * (ST_HD / 2) + i);
        st_rows2(s, n, y0, y1);
        if (lane < n) {
            size_t page = (size_t)layer * a.pages + __ldg(a.page_tab + (size_t)tl * a.ms + pos / SPLIT_KV);
            int slot = pos % SPLIT_KV;
            if (r < ST_D + ST_HKV * ST_HD) {
                float o0 = __fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, sn));
                float o1 = __fadd_rn(__fmul_rn(y0, sn), __fmul_rn(y1, c));
                int rk = r - ST_D;
                float* dst = r < ST_D ? a.q + (size_t)lane * ST_D + r
                                      : a.kc + ((page * ST_HKV + rk / ST_HD) * SPLIT_KV + slot) * ST_HD + rk % ST_HD;
                dst[0] = o0;
                dst[1] = o1;
            } else {
                int rv = r - ST_D - ST_HKV * ST_HD;
                float* dst = a.vc + ((page * ST_HKV + rv / ST_HD) * SPLIT_KV + slot) * ST_HD + rv % ST_HD;
                dst[0] = y0;
                dst[1] = y1;
            }
        }
    }
    st_store_warp(s);
}

// Attention of the tile's tokens: one task per token, KV head and 32 output dimensions.
__device__ __noinline__ void st_attend() {
    const StepArgs& a = st_a;
    int it = st_it, layer = it % a.layers, m0 = it / a.layers * ST_TM, n = min(ST_TM, a.M - m0);
    st_sync(2);
    for (int task = blockIdx.x; task < n * ST_HKV * ST_DQ; task += gridDim.x) {
        int mt = task / (ST_HKV * ST_DQ);
        st_attention(layer, m0 + mt, mt, (task / ST_DQ) % ST_HKV, task % ST_DQ);
    }
}

// O of the tile's attention output plus the residual (the layer's input rows m0 ..) into h1.
__device__ __noinline__ void st_o() {
    const StepArgs& a = st_a;
    int it = st_it, layer = it % a.layers, m0 = it / a.layers * ST_TM, n = min(ST_TM, a.M - m0);
    st_sync(3);
    int lane = threadIdx.x & 31, gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    float* xs = st_xs();
    const float* hin = layer > 0 ? a.h : a.h0;
    st_stage<false>(xs, xs + ST_XS, a.att, nullptr, 0, n, nullptr, 0.0f);
    StWarp s = st_load_warp();
    for (int p = gw; p < ST_D / 2; p += gridDim.x * ST_WARPS) {
        float y0, y1;
        const float* rp = hin + (size_t)(m0 + min(lane, n - 1)) * ST_D + 2 * p;
        float r0 = __ldcg(rp), r1 = __ldcg(rp + 1);
        st_rows2(s, n, y0, y1);
        if (lane < n) {
            a.h1[(size_t)lane * ST_D + 2 * p] = __fadd_rn(r0, y0);
            a.h1[(size_t)lane * ST_D + 2 * p + 1] = __fadd_rn(r1, y1);
        }
    }
    st_store_warp(s);
}

// gate/up of the tile's RMSNorm of h1 and the SiLU gate into act.
__device__ __noinline__ void st_gate_up() {
    const StepArgs& a = st_a;
    int it = st_it, layer = it % a.layers, n = min(ST_TM, a.M - it / a.layers * ST_TM);
    st_sync(4);
    int lane = threadIdx.x & 31, gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    float* xs = st_xs();
    st_stage<true>(xs, xs + ST_XS, a.h1, nullptr, 0, n, a.norms[2 * layer + 1], a.eps);
    StWarp s = st_load_warp();
    for (int p = gw; p < ST_F; p += gridDim.x * ST_WARPS) {
        float g, u;
        st_rows2(s, n, g, u);
        if (lane < n) a.act[(size_t)lane * ST_F + p] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, bx_exp32(-g))), u);
    }
    st_store_warp(s);
}

// down of act plus the residual h1 into h rows m0 ..: the input in K-slices of ST_SL chunk
// steps (slice s + 1 copied while slice s is added), every warp of the block in step.
__device__ __noinline__ void st_down() {
    const StepArgs& a = st_a;
    int n = min(ST_TM, a.M - st_it / a.layers * ST_TM);
    st_sync(5);
    int lane = threadIdx.x & 31, gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    float* xs = st_xs();
    StWarp s = st_load_warp();
    for (int p0 = 0; p0 < ST_D / 2; p0 += gridDim.x * ST_WARPS) {
        int p = p0 + gw;
        bool live = p < ST_D / 2;
        // the residual is read after the sums (registers are the limit here), from L1: fetched now
        bx_prefetch_l1(a.h1 + (size_t)min(lane, n - 1) * ST_D + 2 * min(p, ST_D / 2 - 1));
        float a0[ST_TM], a1[ST_TM];
#pragma unroll
        for (int t = 0; t < ST_TM; ++t) a0[t] = a1[t] = 0.0f;
        constexpr int NS = (ST_F >> 8) / ST_SL, BUF = ST_TM * ST_SL * 256;
        // a live warp's wait for the next slice leaves its ST_SL newest groups (its chunks) pending
        st_slice_copy(xs, a.act, 0, n);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        for (int sl = 0; sl < NS; ++sl) {
            if (sl + 1 < NS) st_slice_copy(xs + ((sl + 1) & 1) * BUF, a.act, sl + 1, n);
            if (live)
                for (int jj = 0; jj < ST_SL; ++jj)
                    st_chunk(s, xs + (sl & 1) * BUF + st_xpos(jj, lane, 0), ST_SL * 256, n, a0, a1);
            if (sl + 1 < NS) {
                if (live) asm volatile("cp.async.wait_group %0;" ::"n"(ST_SL) : "memory");
                else asm volatile("cp.async.wait_group 0;" ::: "memory");
            }
            __syncthreads();
        }
        if (live) {
            const float* rp = a.h1 + (size_t)min(lane, n - 1) * ST_D + 2 * p;
            float r0 = __ldca(rp), r1 = __ldca(rp + 1), y0, y1;
            st_finish(a0, a1, n, y0, y1);
            int m0 = st_it / a.layers * ST_TM;  // the tile's first token (read here: registers)
            if (lane < n) {
                a.h[(size_t)(m0 + lane) * ST_D + 2 * p] = __fadd_rn(r0, y0);
                a.h[(size_t)(m0 + lane) * ST_D + 2 * p + 1] = __fadd_rn(r1, y1);
            }
        }
    }
    st_store_warp(s);
}

// The final RMSNorm and the LM head of the wanted rows into logits, ST_TM rows at a time.
__device__ __noinline__ void st_head() {
    const StepArgs& a = st_a;
    int lane = threadIdx.x & 31, gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    float* xs = st_xs();
    st_sync(1);  // st_it: every (tile, layer) done
    StWarp s = st_load_warp();
    for (int r0 = 0; r0 < a.R; r0 += ST_TM) {
        int n = min(ST_TM, a.R - r0);
        __syncthreads();  // every warp of the block is done with the last row tile's staged rows
        st_stage<true>(xs, xs + ST_XS, a.h, a.rows, r0, n, a.norms[2 * a.layers], a.eps);
        for (int p = gw; p < (a.vocab + 1) / 2; p += gridDim.x * ST_WARPS) {
            float y0, y1;
            st_rows2(s, n, y0, y1);
            if (lane < n) {
                a.logits[(size_t)(r0 + lane) * a.vocab + 2 * p] = y0;
                if (2 * p + 1 < a.vocab) a.logits[(size_t)(r0 + lane) * a.vocab + 2 * p + 1] = y1;
            }
        }
    }
    st_store_warp(s);
}

extern "C" __global__ void __launch_bounds__(32 * ST_WARPS, 1) step(const __grid_constant__ StepArgs args) {
    bx_pdl_wait();
    for (int i = threadIdx.x; i < (int)(sizeof(StepArgs) / 4); i += blockDim.x)
        ((unsigned int*)&st_a)[i] = ((const unsigned int*)&args)[i];
    if (threadIdx.x == 0) {
        st_lim[0] = 4 * args.layers * ((args.M + ST_TM - 1) / ST_TM);
        st_lim[1] = st_lim[0] + (args.R + ST_TM - 1) / ST_TM;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // every flag holds the last launch's final barrier number
        unsigned int e;
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(e) : "l"(args.flags + blockIdx.x) : "memory");
        st_e0 = e;
        st_it = 0;
    }
    {
        int gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;  // pairs spread over blocks first
        StWarp s;
        s.w = 0, s.p = gw, s.j = 0, s.ps = 0;
        st_skip(s, gw);
        for (int i = 0; i < ST_STAGES - 1; ++i) st_issue(s);
        st_store_warp(s);
    }
    __syncthreads();
    st_time(0);
    // Barriers per (tile, layer): before Q/K/V (not the first), attention, O, gate/up and down.
    while (*(volatile int*)&st_it < (args.M + ST_TM - 1) / ST_TM * args.layers) {
        st_qkv();
        st_attend();
        st_o();
        st_gate_up();
        st_down();
        __syncthreads();
        if (threadIdx.x == 0) ++st_it;
        __syncthreads();
    }
    st_head();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    st_time(5 * st_it + 2);
}
