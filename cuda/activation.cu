// bitexact: SiLU gate (docs/determinism.md section 6, step 8).
// Launcher: node/backend_cuda.py launch_silu_gate. Twin: node/reference.py silu_gate
// (then reference.lane_major when V > 0).
#include "common.cuh"

// g, u fp32 [n / K, K]; out row-major (V == 0) or lane-major with chunks of V.
extern "C" __global__ void silu_gate(const float* __restrict__ g, const float* __restrict__ u,
                                     float* __restrict__ out, long long n, int K, int V) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = g[i];
    long long row = i / K;
    out[row * K + bx_lane_pos((int)(i - row * K), K, V)] =
        __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, bx_exp32(-gv))), u[i]);
}
