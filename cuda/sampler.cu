// bitexact: greedy token selection (docs/determinism.md section 10).
// Launcher: node/backend_cuda.py launch_argmax. Twin: numpy.argmax in node/sampler.py
// (the lowest id among the maxima). Seeded sampling runs on the host from the
// same fp32 logits, which are copied back for the digest chain anyway.
#include "common.cuh"

// One block of 256 threads per row of logits [R, V]. nan[r] = 1 if a NaN is present.
extern "C" __global__ void argmax(const float* __restrict__ logits, int* __restrict__ out,
                                  int* __restrict__ nan, int R, int V) {
    __shared__ float bv[256];
    __shared__ int bi[256];
    __shared__ int bn[256];
    int r = blockIdx.x, j = threadIdx.x;
    const float* row = logits + (size_t)r * V;
    float best = -__int_as_float(0x7f800000);
    int idx = 0x7fffffff, has_nan = 0;
    for (int i = j; i < V; i += blockDim.x) {
        float v = row[i];
        if (v != v) has_nan = 1;
        else if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    bv[j] = best; bi[j] = idx; bn[j] = has_nan;
    __syncthreads();
    for (int w = blockDim.x >> 1; w > 0; w >>= 1) {
        if (j < w) {
            float v = bv[j + w];
            int i = bi[j + w];
            if (v > bv[j] || (v == bv[j] && i < bi[j])) { bv[j] = v; bi[j] = i; }
            bn[j] |= bn[j + w];
        }
        __syncthreads();
    }
    if (j == 0) { out[r] = bi[0]; nan[r] = bn[0]; }
}
