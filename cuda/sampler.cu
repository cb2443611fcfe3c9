// bitexact: token selection (docs/determinism.md section 10).
// Kernels: argmax, sample_keys, sample_sorted. Launchers with shape checks:
// node/backend_cuda.py launch_argmax, launch_sample_keys, launch_sample_sorted
// (CudaBackend.sample sorts the keys between the last two), in the same order. Twins: numpy.argmax (the lowest
// id among the maxima) and node/sampler.py sample_keys, sample_sorted.
#include "common.cuh"

// One block of 256 threads per row of logits [R, V]. nan[r] = 1 if a NaN is present.
extern "C" __global__ void argmax(const float* __restrict__ logits, int* __restrict__ out,
                                  int* __restrict__ nan, int R, int V) {
    bx_pdl_wait();
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

// ---- sample_keys: z = logits / T and each candidate's sort key --------------
// One thread per element of logits [R, V]; temp [R]. keys uint64 [R, V]: high
// word the complement of the order-preserving bits of z + 0 (-0 becomes +0),
// low word the id, so ascending keys order by (z descending, id ascending).
// bad[r] is set to 1 when some z of row r is not finite (the launcher zeroes it;
// threads that find one all store the same 1).
extern "C" __global__ void sample_keys(const float* __restrict__ logits, const float* __restrict__ temp,
                                       unsigned long long* __restrict__ keys, int* __restrict__ bad, int R,
                                       int V) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)R * V) return;
    int r = (int)(i / V);
    unsigned int id = (unsigned int)(i - (long long)r * V);
    float z = __fdiv_rn(logits[i], temp[r]);
    if (!(fabsf(z) <= __int_as_float(0x7f7fffff))) bad[r] = 1;
    unsigned int b = __float_as_uint(__fadd_rn(z, 0.0f));
    unsigned int asc = (b >> 31) ? ~b : (b | 0x80000000u);
    keys[i] = ((unsigned long long)(~asc) << 32) | id;
}

// Philox4x32-10 (Salmon et al., SC 2011) with key (k0, k1) and counter
// (pos, 0, 0, 0); the uniform (2 * (w0 >> 9) + 1) * 2^-24 of node/sampler.py uniform.
__device__ __forceinline__ float bx_uniform(unsigned int k0, unsigned int k1, unsigned int pos) {
    unsigned int c0 = pos, c1 = 0u, c2 = 0u, c3 = 0u;
#pragma unroll
    for (int i = 0; i < 10; ++i) {
        if (i) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
    }
    return __fmul_rn((float)(2u * (c0 >> 9) + 1u), __int_as_float(0x33800000));  // exact: < 2^24 times 2^-24
}

// ---- sample_sorted: the seeded top-k/top-p draw over keys in ascending order -
// One block per row r of logits [R, V] and sorted keys [R, V]. The first
// n = top_k[r] (all when 0 or >= V) candidates: the block computes
// e_j = exp32(z_j - z_0) into c; thread 0 turns c into sequential fp32 prefix
// sums, finds keep = 1 + the first j with c_j >= top_p * c_last and the first
// j < keep with c_j > u * c_{keep-1} (else keep - 1) by binary search (c never
// decreases: every e_j >= 0), and writes that candidate's id to out[r].
// seed [R, 2] uint32 (low word, high word); pos [R] uint32; c fp32 scratch [R, V].
extern "C" __global__ void sample_sorted(const float* __restrict__ logits,
                                         const unsigned long long* __restrict__ sorted,
                                         const float* __restrict__ temp, const int* __restrict__ top_k,
                                         const float* __restrict__ top_p, const unsigned int* __restrict__ seed,
                                         const unsigned int* __restrict__ pos, float* __restrict__ c,
                                         int* __restrict__ out, int R, int V) {
    bx_pdl_wait();
    int r = blockIdx.x;
    if (r >= R) return;  // uniform per block
    const float* lg = logits + (size_t)r * V;
    const unsigned long long* sk = sorted + (size_t)r * V;
    float* cr = c + (size_t)r * V;
    int k = top_k[r], n = (k > 0 && k < V) ? k : V;
    float t = temp[r];
    float z0 = __fdiv_rn(lg[(unsigned int)sk[0]], t);
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        cr[j] = bx_exp32(__fsub_rn(__fdiv_rn(lg[(unsigned int)sk[j]], t), z0));
    __syncthreads();
    if (threadIdx.x != 0) return;
    float acc = cr[0];
    for (int j = 1; j < n; ++j) {
        acc = __fadd_rn(acc, cr[j]);
        cr[j] = acc;
    }
    float thr = __fmul_rn(top_p[r], acc);
    int lo = 0, hi = n - 1;  // c_{n-1} = acc >= thr since top_p <= 1
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (cr[mid] >= thr) hi = mid; else lo = mid + 1;
    }
    int keep = lo + 1;
    float target = __fmul_rn(bx_uniform(seed[2 * r], seed[2 * r + 1], pos[r]), cr[keep - 1]);
    lo = 0;
    hi = keep - 1;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (cr[mid] > target) hi = mid; else lo = mid + 1;
    }
    out[r] = (int)(unsigned int)sk[lo];
}
