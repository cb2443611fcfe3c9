// bitexact: RMSNorm (docs/determinism.md section 6, step 1).
// Launcher: node/backend_cuda.py launch_rms_norm. Twin: node/reference.py rms_norm
// (then reference.lane_major when V > 0).
#include "common.cuh"

// One block of 128 threads per token row. Warp 0: lane l sums x*x over
// k = l*g .. l*g+g-1, butterfly, inv = 1 / sqrt(ss / K + eps). Then every
// thread writes y = (x * inv) * w, row-major (V == 0) or lane-major with
// chunks of V elements for matmul_f.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ y, int M, int K, float eps, int V) {
    __shared__ float inv_s;
    int m = blockIdx.x;
    if (m >= M) return;  // uniform per block
    const float* xr = x + (size_t)m * K;
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
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
        if (lane == 0) inv_s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
    }
    __syncthreads();
    float inv = inv_s;
    for (int k = threadIdx.x; k < K; k += blockDim.x)
        y[(size_t)m * K + bx_lane_pos(k, K, V)] = __fmul_rn(__fmul_rn(xr[k], inv), w[k]);
}
