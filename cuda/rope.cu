// bitexact: RoPE on adjacent pairs (docs/determinism.md section 7).
// Launcher: node/backend_cuda.py launch_rope. Twin: node/reference.py rope.
#include "common.cuh"

// x, out fp32 [M, H, hd]; cos, sin fp32 [M, hd/2] (table rows at each token's position).
extern "C" __global__ void rope(const float* __restrict__ x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, float* __restrict__ out, int M, int H, int hd) {
    int half = hd >> 1;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * H * half) return;
    int p = (int)(i % half);
    long long mh = i / half;
    int m = (int)(mh / H);
    float c = cos_t[(size_t)m * half + p], s = sin_t[(size_t)m * half + p];
    float a = x[mh * hd + 2 * p], b = x[mh * hd + 2 * p + 1];
    out[mh * hd + 2 * p] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    out[mh * hd + 2 * p + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}
