// bitexact: causal GQA attention with fixed 256-position KV splits
// (docs/determinism.md section 8). The KV cache is paged: one page holds one
// split (256 positions) of one sequence: [n_pages, Hkv, 256, hd] fp32 per layer.
// Kernels: attention_split, attention_combine (rope.cu stores the keys and
// values). Launcher with shape checks: node/backend_cuda.py launch_attention.
// Twins: node/reference.py attention_split and attention_combine (driven by attention).
#include "common.cuh"

// One block of 256 threads (8 warps) per (token t, head h, split c); slots
// past the query's position are skipped (they add +0 in the contract).
// Scores: a warp per slot, lane l adds q*k over d = l*g .. l*g+g-1 in order,
// then the butterfly (warp_sum over hd), times scale. Softmax terms
// e_j = exp32(s_j - m_c). Output: lane l of the contract owns slots
// 8l .. 8l+7 (warp_sum over 256 slots, g = 8); thread (d, half) computes those
// lane partials for lanes half, half+2, ... (the 8 loads of a lane in flight
// at once), then one thread per d adds the 32 partials in the tree.
// Writes the split's max m_c, sum l_c and unnormalised output o_c[hd].
// pages: int [T, max_splits] page id of each split of the token's sequence.
// Dynamic shared memory: (hd + 256 + 32 hd) floats.
extern "C" __global__ void __launch_bounds__(SPLIT_KV) attention_split(
    const float* __restrict__ q, const float* __restrict__ kp, const float* __restrict__ vp,
    const int* __restrict__ pages, const int* __restrict__ qpos, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_o, int T, int H, int Hkv, int hd, int max_splits,
    float scale) {
    extern __shared__ float smem[];
    float* qs = smem;                     // [hd]
    float* e = qs + hd;                   // [256] scores, then softmax terms
    float* part = e + SPLIT_KV;           // [32][hd]
    __shared__ float wmax[SPLIT_KV / 32];
    int t = blockIdx.x, h = blockIdx.y, c = blockIdx.z, j = threadIdx.x;
    int lane = j & 31, warp = j >> 5;
    bx_pdl_wait();
    int p = qpos[t];
    size_t page = (size_t)pages[(size_t)t * max_splits + c];  // loaded with p: one round trip
    for (int d = j; d < hd; d += blockDim.x) qs[d] = q[((size_t)t * H + h) * hd + d];
    if (SPLIT_KV * c > p) return;  // this split does not exist for this query (uniform)
    int n_valid = min(SPLIT_KV, p - SPLIT_KV * c + 1);  // slots 0 .. n_valid-1 are keys at or before p
    int kvh = h / (H / Hkv);
    const float* kbase = kp + (page * Hkv + kvh) * SPLIT_KV * hd;
    const float* vbase = vp + (page * Hkv + kvh) * SPLIT_KV * hd;
    // The split's keys and values (written by the previous kernel) into L1 before the scores read them.
    int lines = (n_valid * hd + 31) >> 5;  // 128-byte lines of each
    for (int i = j; i < 2 * lines; i += blockDim.x) bx_prefetch_l1(i < lines ? kbase + 32 * i : vbase + 32 * (i - lines));
    __syncthreads();
    int g = (hd + 31) >> 5;
    int d0 = lane * g, dn = min(g, hd - d0);  // this lane's d range of the score sum
#pragma unroll 4
    for (int slot = warp; slot < n_valid; slot += SPLIT_KV / 32) {
        const float* kr = kbase + (size_t)slot * hd + d0;
        float acc = 0.0f;
        for (int i = 0; i < dn; ++i) acc = __fadd_rn(acc, __fmul_rn(qs[d0 + i], kr[i]));
        float s = __fmul_rn(bx_butterfly(acc), scale);
        if (lane == 0) e[slot] = s;
    }
    __syncthreads();
    float s = j < n_valid ? e[j] : -__int_as_float(0x7f800000);
    float mx = s;  // max is exact in any order: warp shuffles, then the 8 warp maxima
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(BX_FULL, mx, off));
    if (lane == 0) wmax[warp] = mx;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SPLIT_KV / 32; ++i) mx = fmaxf(mx, wmax[i]);
    float m_c = mx;
    float ej = j < n_valid ? bx_exp32(__fsub_rn(s, m_c)) : 0.0f;
    e[j] = ej;  // each thread rewrites only its own slot
    __syncthreads();
    int n_lanes = (n_valid + 7) >> 3;  // contract lanes holding at least one valid slot
    int halves = max(1, (int)blockDim.x / hd);  // threads per d
    for (int idx = j; idx < halves * hd; idx += blockDim.x) {
        int d = idx % hd, half = idx / hd;
        for (int l = half; l < 32; l += halves) {
            float acc = 0.0f;
            if (l < n_lanes) {
                float vv[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    int slot = 8 * l + i;
                    vv[i] = slot < n_valid ? vbase[(size_t)slot * hd + d] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    if (8 * l + i < n_valid) acc = __fadd_rn(acc, __fmul_rn(e[8 * l + i], vv[i]));
            }
            part[l * hd + d] = acc;
        }
    }
    __syncthreads();
    size_t out = ((size_t)t * H + h) * max_splits + c;
    for (int d = j; d < hd; d += blockDim.x) {
        float lanes[32];
#pragma unroll
        for (int l = 0; l < 32; ++l) lanes[l] = part[l * hd + d];
        part_o[out * hd + d] = bx_tree<BX_WARP>(lanes);
    }
    if (warp == 0) {  // l_c: lane l adds e over its slots 8l .. 8l+7, then the butterfly
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = __fadd_rn(acc, e[8 * lane + i]);
        float l_c = bx_butterfly(acc);
        if (lane == 0) {
            part_l[out] = l_c;
            part_m[out] = m_c;
        }
    }
}

// One block per (token, head), thread d: combine splits 0 .. p/256 in order.
// out [T, H*hd]: row-major (V == 0) or lane-major with chunks of V for matmul_f,
// or (V < 0, hd % 32 == 0) the q8 codes q, scales qd and code sums qa of its
// 32-element blocks for matmul_q (twin: reference.quantize_q8 of the output).
extern "C" __global__ void attention_combine(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                             const float* __restrict__ part_o, const int* __restrict__ qpos,
                                             float* __restrict__ out, signed char* __restrict__ q,
                                             float* __restrict__ qd, int* __restrict__ qa, int T, int H, int hd,
                                             int max_splits, int V) {
    bx_pdl_wait();
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;  // uniform per warp when V < 0 (hd % 32 == 0)
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
    float y = __fdiv_rn(O, L);
    size_t e = (size_t)t * H * hd + h * hd + d;
    if (V < 0) bx_quantize_block(y, d & 31, q + e, qd + (e >> 5), qa + (e >> 5));
    else out[(size_t)t * H * hd + bx_lane_pos(h * hd + d, H * hd, V)] = y;
}
