// bitexact: causal GQA attention with fixed 256-position KV splits
// (docs/determinism.md section 8). The KV cache is paged: one page holds one
// split (256 positions) of one sequence: [n_pages, Hkv, 256, hd] fp32 per layer.
// Kernels: kv_store, attention_split, attention_combine. Launchers with shape
// checks: node/backend_cuda.py launch_kv_store, launch_attention (same order).
// Twin: node/reference.py attention.
#include "common.cuh"

#define SPLIT_KV 256

// k, v fp32 [T, Hkv, hd] -> page tok_page[t], slot tok_slot[t].
extern "C" __global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v,
                                    float* __restrict__ kp, float* __restrict__ vp,
                                    const int* __restrict__ tok_page, const int* __restrict__ tok_slot,
                                    int T, int Hkv, int hd) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * Hkv * hd) return;
    int d = (int)(i % hd);
    int h = (int)((i / hd) % Hkv);
    int t = (int)(i / ((long long)hd * Hkv));
    size_t dst = (((size_t)tok_page[t] * Hkv + h) * SPLIT_KV + tok_slot[t]) * hd + d;
    kp[dst] = k[i];
    vp[dst] = v[i];
}

// One block of 256 threads per (token t, head h, split c). Thread j is slot j.
// Writes the split's max m_c, sum l_c and unnormalised output o_c[hd].
// pages: int [T, max_splits] page id of each split of the token's sequence.
extern "C" __global__ void attention_split(const float* __restrict__ q, const float* __restrict__ kp,
                                           const float* __restrict__ vp, const int* __restrict__ pages,
                                           const int* __restrict__ qpos, float* __restrict__ part_m,
                                           float* __restrict__ part_l, float* __restrict__ part_o,
                                           int T, int H, int Hkv, int hd, int max_splits, float scale) {
    extern __shared__ float smem[];
    float* qs = smem;                     // [hd]
    float* e = qs + hd;                   // [256]
    float* part = e + SPLIT_KV;           // [32][hd]
    __shared__ float m_c;
    int t = blockIdx.x, h = blockIdx.y, c = blockIdx.z, j = threadIdx.x;
    int p = qpos[t];
    if (SPLIT_KV * c > p) return;  // this split does not exist for this query (uniform)
    int kvh = h / (H / Hkv);
    for (int d = j; d < hd; d += blockDim.x) qs[d] = q[((size_t)t * H + h) * hd + d];
    __syncthreads();
    size_t page = (size_t)pages[(size_t)t * max_splits + c];
    const float* kbase = kp + (page * Hkv + kvh) * SPLIT_KV * hd;
    const float* vbase = vp + (page * Hkv + kvh) * SPLIT_KV * hd;
    bool valid = SPLIT_KV * c + j <= p;
    float s = -__int_as_float(0x7f800000);
    if (valid) {  // s = warp_sum over hd of q*k, computed by this thread, then * scale
        const float* kr = kbase + (size_t)j * hd;
        int g = (hd + 31) >> 5;
        float lanes[32];
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            float acc = 0.0f;
            for (int i = 0; i < g; ++i) {
                int d = l * g + i;
                if (d < hd) acc = __fadd_rn(acc, __fmul_rn(qs[d], kr[d]));
            }
            lanes[l] = acc;
        }
        s = __fmul_rn(bx_tree32(lanes), scale);
    }
    float mx = s;  // max is exact in any order: warp shuffles, then the 8 warp maxima
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(BX_FULL, mx, off));
    if ((j & 31) == 0) e[j >> 5] = mx;
    __syncthreads();
    if (j == 0) {
        for (int i = 1; i < SPLIT_KV / 32; ++i) mx = fmaxf(mx, e[i]);
        m_c = mx;
    }
    __syncthreads();
    float ej = valid ? bx_exp32(__fsub_rn(s, m_c)) : 0.0f;
    __syncthreads();
    e[j] = ej;
    __syncthreads();
    // Lane partials: lane l owns slots 8l .. 8l+7 (warp_sum over 256 slots, g = 8).
    size_t out = ((size_t)t * H + h) * max_splits + c;
    for (int idx = j; idx < 32 * hd; idx += blockDim.x) {
        int l = idx / hd, d = idx % hd;
        float acc = 0.0f;
        for (int i = 0; i < 8; ++i) {
            int slot = 8 * l + i;
            float term = (SPLIT_KV * c + slot <= p) ? __fmul_rn(e[slot], vbase[(size_t)slot * hd + d]) : 0.0f;
            acc = __fadd_rn(acc, term);
        }
        part[l * hd + d] = acc;
    }
    __syncthreads();
    for (int d = j; d < hd; d += blockDim.x) {
        float lanes[32];
#pragma unroll
        for (int l = 0; l < 32; ++l) lanes[l] = part[l * hd + d];
        part_o[out * hd + d] = bx_tree32(lanes);
    }
    if (j == 0) {
        float lanes[32];
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            float acc = 0.0f;
            for (int i = 0; i < 8; ++i) acc = __fadd_rn(acc, e[8 * l + i]);
            lanes[l] = acc;
        }
        part_l[out] = bx_tree32(lanes);
        part_m[out] = m_c;
    }
}

// One block per (token, head), thread d: combine splits 0 .. p/256 in order.
// out [T, H*hd]: row-major (V == 0) or lane-major with chunks of V for matmul_f.
extern "C" __global__ void attention_combine(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                             const float* __restrict__ part_o, const int* __restrict__ qpos,
                                             float* __restrict__ out, int T, int H, int hd, int max_splits, int V) {
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    int n_split = qpos[t] / SPLIT_KV + 1;
    size_t base = ((size_t)t * H + h) * max_splits;
    float mx = part_m[base];
    for (int c = 1; c < n_split; ++c) mx = fmaxf(mx, part_m[base + c]);
    float L = 0.0f, O = 0.0f;
    for (int c = 0; c < n_split; ++c) {
        float w = bx_exp32(__fsub_rn(part_m[base + c], mx));
        L = __fadd_rn(L, __fmul_rn(part_l[base + c], w));
        O = __fadd_rn(O, __fmul_rn(part_o[(base + c) * hd + d], w));
    }
    out[(size_t)t * H * hd + bx_lane_pos(h * hd + d, H * hd, V)] = __fdiv_rn(O, L);
}
