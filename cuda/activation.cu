// bitexact: SiLU gate (docs/determinism.md section 6, step 8).
// Launcher: node/backend_cuda.py launch_silu_gate. Twin: node/reference.py silu_gate.
#include "common.cuh"

extern "C" __global__ void silu_gate(const float* __restrict__ g, const float* __restrict__ u,
                                     float* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = g[i];
    out[i] = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, bx_exp32(-gv))), u[i]);
}
