// bitexact: SiLU gate (docs/determinism.md section 6, step 8).
// Launcher: node/backend_cuda.py launch_silu_gate. Twin: node/reference.py silu_gate
// (then reference.lane_major when V > 0, reference.quantize_q8 when V < 0).
#include "common.cuh"

// g, u fp32 [n / K, K]; out row-major (V == 0) or lane-major with chunks of V;
// or (V < 0, K % 32 == 0) q8 codes q, and per 32-element block (one warp each)
// the scale qd and code sum qa.
extern "C" __global__ void silu_gate(const float* __restrict__ g, const float* __restrict__ u,
                                     float* __restrict__ out, signed char* __restrict__ q, float* __restrict__ qd,
                                     int* __restrict__ qa, long long n, int K, int V) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // n % 32 == 0 when V < 0: uniform per warp
    float gv = g[i];
    float v = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, bx_exp32(-gv))), u[i]);
    if (V < 0) {
        bx_quantize_block(v, (int)(i & 31), q + i, qd + (i >> 5), qa + (i >> 5));
        return;
    }
    long long row = i / K;
    out[row * K + bx_lane_pos((int)(i - row * K), K, V)] = v;
}
