// bitexact: RoPE on adjacent pairs (docs/determinism.md section 7), fused with
// the store of the step's keys and values into the paged KV cache.
// Launcher: node/backend_cuda.py launch_rope. Twin: node/reference.py rope
// (the store is a copy; node/backend_cpu.py attend does it on the host).
#include "common.cuh"

// One thread per pair (2p, 2p+1) of a head of q or k, heads of q first:
// q fp32 [T, H, hd] -> q_out (rotated); k fp32 [T, Hkv, hd] -> rotated into
// page tok_page[t], slot tok_slot[t] of kp ([pages, Hkv, SPLIT_KV, hd]); the
// same pair of v is copied to vp. cos, sin fp32 [T, hd/2] (table rows at each
// token's position).
extern "C" __global__ void rope(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, float* __restrict__ q_out, float* __restrict__ kp,
                                float* __restrict__ vp, const int* __restrict__ tok_page,
                                const int* __restrict__ tok_slot, int T, int H, int Hkv, int hd) {
    bx_pdl_wait();
    int half = hd >> 1, heads = H + Hkv;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * heads * half) return;
    int p = (int)(i % half);
    int h = (int)((i / half) % heads);
    int t = (int)(i / ((long long)half * heads));
    float c = cos_t[(size_t)t * half + p], s = sin_t[(size_t)t * half + p];
    bool is_q = h < H;
    const float* src = is_q ? q + ((size_t)t * H + h) * hd : k + ((size_t)t * Hkv + (h - H)) * hd;
    float a = src[2 * p], b = src[2 * p + 1];
    float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    if (is_q) {
        float* dst = q_out + ((size_t)t * H + h) * hd;
        dst[2 * p] = ra;
        dst[2 * p + 1] = rb;
    } else {
        size_t kv = (size_t)t * Hkv + (h - H);
        size_t at = (((size_t)tok_page[t] * Hkv + (h - H)) * SPLIT_KV + tok_slot[t]) * hd + 2 * p;
        kp[at] = ra;
        kp[at + 1] = rb;
        vp[at] = v[kv * hd + 2 * p];
        vp[at + 1] = v[kv * hd + 2 * p + 1];
    }
}
