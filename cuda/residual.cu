// bitexact: residual add (docs/determinism.md section 6, steps 6 and 9).
// Launcher: node/backend_cuda.py launch_residual_add. Twin: node/reference.py residual_add.
#include "common.cuh"

extern "C" __global__ void residual_add(const float* __restrict__ x, const float* __restrict__ y,
                                        float* __restrict__ out, long long n) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = __fadd_rn(x[i], y[i]);
}
