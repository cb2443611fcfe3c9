// bitexact: tensor-parallel combine (docs/determinism.md section 12).
// Launcher: node/backend_cuda.py launch_tp_combine. Twin: node/reference.py tp_combine.
#include "common.cuh"

// ---- tp_combine: the T gathered partials of a row-parallel product ----------
// p [T, n] (rank order) -> y [n]: the contract tree's top log2(T) levels,
// neighbours first: T = 4 gives (p0 + p1) + (p2 + p3). T is 1, 2, 4 or 8.
extern "C" __global__ void tp_combine(const float* __restrict__ p, float* __restrict__ y, long long n, int T) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = t < T ? p[t * n + i] : 0.0f;
#pragma unroll
    for (int w = 1; w < 8; w <<= 1)
#pragma unroll
        for (int j = 0; j < 8; j += 2 * w)
            if (w < T) v[j] = __fadd_rn(v[j], v[j + w]);
    y[i] = v[0];
}
