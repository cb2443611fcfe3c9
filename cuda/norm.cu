// bitexact: RMSNorm (docs/determinism.md section 6, step 1).
// Launcher: node/backend_cuda.py launch_rms_norm. Twin: node/reference.py rms_norm
// (then reference.lane_major when V > 0, reference.quantize_q8 when V < 0).
#include "common.cuh"

#define RN_THREADS 1024  // threads per block; none changes a sum (warp 0 alone adds x*x)
extern "C" __constant__ int bx_rn_threads = RN_THREADS;  // read by node/backend_cuda.py
#define RN_BATCH 8  // elements per thread loaded before any is stored

// One block of RN_THREADS threads per token row. All threads first stage the
// row x and the weights w in shared memory (coalesced loads, RN_BATCH of each
// in flight per thread); x is stored skewed by one word per lane segment (element k at
// k + k/g), so warp 0's lanes read their segments without bank conflicts.
// Warp 0: lane l sums x*x over k = l*g .. l*g+g-1 in order, butterfly,
// inv = 1 / sqrt(ss / K + eps). Then every thread writes y = (x * inv) * w,
// row-major (V == 0) or lane-major with chunks of V elements for matmul_f, or
// (V < 0, K % 32 == 0) its q8 code into q, and each warp the scale qd and code
// sum qa of the 32-element block it holds, for matmul_q.
// Dynamic shared memory: (2K + 32) floats.
extern "C" __global__ void __launch_bounds__(RN_THREADS) rms_norm(const float* __restrict__ x,
                                                                  const float* __restrict__ w,
                                                                  float* __restrict__ y, signed char* __restrict__ q,
                                                                  float* __restrict__ qd, int* __restrict__ qa, int M,
                                                                  int K, float eps, int V) {
    bx_pdl_wait();
    extern __shared__ float sm[];
    float* xs = sm;           // [K + 32], skewed
    float* ws = sm + K + 32;  // [K]
    __shared__ float inv_s;
    int m = blockIdx.x;
    if (m >= M) return;  // uniform per block
    const float* xr = x + (size_t)m * K;
    int g = (K + 31) >> 5;
    for (int k0 = 0; k0 < K; k0 += RN_BATCH * RN_THREADS) {  // RN_BATCH loads of x and of w in flight
        float xv[RN_BATCH], wv[RN_BATCH];
#pragma unroll
        for (int i = 0; i < RN_BATCH; ++i) {
            int k = k0 + i * RN_THREADS + threadIdx.x;
            xv[i] = k < K ? xr[k] : 0.0f;
            wv[i] = k < K ? w[k] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < RN_BATCH; ++i) {
            int k = k0 + i * RN_THREADS + threadIdx.x;
            if (k < K) {
                xs[k + k / g] = xv[i];
                ws[k] = wv[i];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        const float* seg = xs + lane * (g + 1);
        int n = min(g, K - lane * g);
        float acc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n; ++j) acc = __fadd_rn(acc, __fmul_rn(seg[j], seg[j]));
        float ss = bx_butterfly(acc);
        if (lane == 0) inv_s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
    }
    __syncthreads();
    float inv = inv_s;
    for (int k = threadIdx.x; k < K; k += RN_THREADS) {  // a warp holds elements 32j .. 32j + 31
        float v = __fmul_rn(__fmul_rn(xs[k + k / g], inv), ws[k]);
        size_t e = (size_t)m * K + k;
        if (V < 0) bx_quantize_block(v, k & 31, q + e, qd + (e >> 5), qa + (e >> 5));
        else y[(size_t)m * K + bx_lane_pos(k, K, V)] = v;
    }
}
