// bitexact: RMSNorm (docs/determinism.md section 6, step 1).
// Launcher: node/backend_cuda.py launch_rms_norm. Twin: node/reference.py rms_norm.
#include "common.cuh"

// One warp per token row: lane l sums x*x over k = l*g .. l*g+g-1, butterfly,
// inv = 1 / sqrt(ss / K + eps), y = (x * inv) * w.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ y, int M, int K, float eps) {
    int lane = threadIdx.x & 31;
    int m = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (m >= M) return;
    const float* xr = x + (size_t)m * K;
    int g = (K + 31) >> 5;
    float acc = 0.0f;
    if ((K & 127) == 0) {  // 16-byte loads, several in flight; the same terms in the same order
        const float4* seg = (const float4*)(xr + lane * g);
#pragma unroll 8
        for (int j = 0; j < (g >> 2); ++j) {
            float4 v = seg[j];
            acc = __fadd_rn(acc, __fmul_rn(v.x, v.x));
            acc = __fadd_rn(acc, __fmul_rn(v.y, v.y));
            acc = __fadd_rn(acc, __fmul_rn(v.z, v.z));
            acc = __fadd_rn(acc, __fmul_rn(v.w, v.w));
        }
    } else {
        for (int j = 0; j < g; ++j) {
            int k = lane * g + j;
            if (k >= K) break;
            acc = __fadd_rn(acc, __fmul_rn(xr[k], xr[k]));
        }
    }
    float ss = bx_butterfly(acc);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
#pragma unroll 4
    for (int k = lane; k < K; k += 32) y[(size_t)m * K + k] = __fmul_rn(__fmul_rn(xr[k], inv), w[k]);
}
