// bitexact: RMSNorm (docs/determinism.md section 6, step 1).
// Launcher: node/backend_cuda.py launch_rms_norm. Twin: node/reference.py rms_norm
// (then reference.lane_major when V > 0, reference.quantize_q8 when V < 0).
#include "common.cuh"

#define RN_THREADS 1024  // threads per block; none changes a sum (warp 0 alone adds x*x)
extern "C" __constant__ int bx_rn_threads = RN_THREADS;  // read by node/backend_cuda.py
#define RN_BATCH 8  // elements per thread loaded before any is stored
static_assert(RN_THREADS == 32 * BX_WARP, "rms_norm: warp l stages contract segment l, so 32 warps");

// One block of RN_THREADS threads per token row. All threads first stage the
// row x and the weights w in shared memory (RN_BATCH loads of each in flight
// per thread): warp l copies x's contract segment l (k = l*g .. l*g+g-1) to
// l*(g+1), skewed by one word per segment so warp 0's lanes read their
// segments without bank conflicts.
// Warp 0: lane l sums x*x over k = l*g .. l*g+g-1 in order, butterfly,
// inv = 1 / sqrt(ss / K + eps). Then every thread writes y = (x * inv) * w,
// row-major (V == 0) or lane-major with chunks of V elements for matmul_f
// (each thread one output position, its k found by shifts), or
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
    float* xs = sm;           // [K + 32]: segment l at l * (g + 1)
    float* ws = sm + K + 32;  // [K]
    __shared__ float inv_s;
    int m = blockIdx.x;
    if (m >= M) return;  // uniform per block
    const float* xr = x + (size_t)m * K;
    int g = (K + 31) >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = min(g, K - warp * g);  // warp l stages segment l (RN_THREADS / 32 == 32 warps)
    for (int i0 = 0; i0 < (g + 31) >> 5; i0 += RN_BATCH) {  // RN_BATCH loads of x and of w in flight
        float xv[RN_BATCH], wv[RN_BATCH];
#pragma unroll
        for (int i = 0; i < RN_BATCH; ++i) {
            int r = (i0 + i) * 32 + lane, k = (i0 + i) * RN_THREADS + threadIdx.x;
            xv[i] = r < n ? xr[warp * g + r] : 0.0f;
            wv[i] = k < K ? w[k] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < RN_BATCH; ++i) {
            int r = (i0 + i) * 32 + lane, k = (i0 + i) * RN_THREADS + threadIdx.x;
            if (r < n) xs[warp * (g + 1) + r] = xv[i];
            if (k < K) ws[k] = wv[i];
        }
    }
    __syncthreads();
    if (warp == 0) {
        const float* seg = xs + lane * (g + 1);
        int nl = min(g, K - lane * g);
        float acc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < nl; ++j) acc = __fadd_rn(acc, __fmul_rn(seg[j], seg[j]));
        float ss = bx_butterfly(acc);
        if (lane == 0) inv_s = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
    }
    __syncthreads();
    float inv = inv_s;
    if (V > 0) {  // output o = (j * 32 + l) * V + e holds k = l * g + j * V + e (K % 32 == 0, V a power of two)
        int vs = __ffs(V) - 1;
        for (int o = threadIdx.x; o < K; o += RN_THREADS) {
            int l = (o >> vs) & 31, k = l * g + ((o >> vs) >> 5) * V + (o & (V - 1));
            y[(size_t)m * K + o] = __fmul_rn(__fmul_rn(xs[k + l], inv), ws[k]);
        }
        return;
    }
    for (int k = threadIdx.x; k < K; k += RN_THREADS) {  // a warp holds elements 32j .. 32j + 31
        float v = __fmul_rn(__fmul_rn(xs[k + k / g], inv), ws[k]);
        size_t e = (size_t)m * K + k;
        if (V < 0) bx_quantize_block(v, k & 31, q + e, qd + (e >> 5), qa + (e >> 5));
        else y[e] = v;
    }
}
