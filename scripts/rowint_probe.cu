// bitexact: a probe of the rowint route for float weights (docs/benchmarks.md "The route
// past batch 32"), not a kernel of the node: the products of the fp32 contract
// (docs/determinism.md section 5) are what the node runs. scripts/bench_rowint.py compiles
// it, checks it against its numpy twins (scripts/rowint.py quantize_rowint, matmul_rowint)
// byte for byte, and times it.
#include "common.cuh"

// The rowint products: y[m, n] = fp32_rn(I *
// 2^(sx[m] + sw[n])) with the exact integer I = sum_k cx[m, k] cw[n, k]. Weight
// codes (|cw| <= 2^13) are two int8 slices, cw = 128 wh + wl (wl in 0..127);
// input codes (|cx| <= 2^20) three, cx = 2^14 xh + 2^7 xm + xl. Slice products
// of one weight 2^(7j) share an accumulator (j = 0 .. 3), each below 2^31 for
// K < 2^16, so every MMA sum is exact and any split of K or tokens gives the
// same I. Layouts (a permutation, scripts/rowint.py pack_w and pack_x): weights
// per 16-row tile rt, k-step kk (32 elements) and slice s as the 512 bytes of
// the m16n8k32 A fragments in lane order (record ((rt * KS + kk) * 2 + s));
// inputs per 8-token tile tt, k-step kk and slice s as the 256 bytes of the B
// fragments (record ((tt * KS + kk) * 3 + s)), tokens past M zero.
#define RI_WARPS 8  // warps per block; each takes a contiguous share of the k-steps
#ifndef RI_NT
#define RI_NT 2  // 8-token tiles per block (RI_NT * 8 tokens per pass over the weights)
#endif
#ifndef RI_RW
#define RI_RW 2  // 16-row tiles per warp (each input fragment load serves all of them)
#endif

// D[16 x 8] (s32) += A[16 x 32] (s8, rows) * B[32 x 8] (s8, columns), one warp; exact.
__device__ __forceinline__ void bx_mma_s8_acc(const unsigned int* a, unsigned int b0, unsigned int b1, int* d) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 weight bytes no other access of the launch reads: past L1 (as cuda/matmul.cu BxChunk).
__device__ __forceinline__ uint4 bx_ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// quantize_rowint: one block per token (rows past M write zero codes).
extern "C" __global__ void __launch_bounds__(256) quantize_rowint(const float* __restrict__ x,
                                                                  unsigned char* __restrict__ px, int* __restrict__ sx,
                                                                  int M, int K) {
    __shared__ float red[8];
    int m = blockIdx.x, KS = K >> 5;
    bx_pdl_wait();
    float amax = 0.0f;
    if (m < M)
        for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(x[(size_t)m * K + k]));
#pragma unroll
    for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(BX_FULL, amax, off));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) amax = fmaxf(amax, red[i]);
    int s = amax > 0.0f ? ilogbf(amax) - 19 : 0;
    if (m < M && threadIdx.x == 0) sx[m] = s;
    double f = __longlong_as_double((long long)(1023 - s) << 52);  // 2^-s, exact
    int tt = m >> 3, gid = m & 7;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        int c = m < M ? __double2int_rn((double)x[(size_t)m * K + k] * f) : 0;
        int kk = k >> 5, kr = k & 31, lane = gid * 4 + ((kr & 15) >> 2);
        size_t o = (size_t)(tt * KS + kk) * 3 * 256 + lane * 8 + (kr >> 4) * 4 + (kr & 3);
        px[o] = (unsigned char)(c & 127);
        px[o + 256] = (unsigned char)((c >> 7) & 127);
        px[o + 512] = (unsigned char)(c >> 14);
    }
}

// matmul_rowint: block (token pass, row group) computes RI_RW row tiles of 16 rows by RI_NT * 8
// tokens; warp w adds k-steps kk in [w KS / RI_WARPS, (w + 1) KS / RI_WARPS) of every tile; the
// warps' int64 partials meet in shared memory (exact), then each output is scaled once.
extern "C" __global__ void __launch_bounds__(32 * RI_WARPS) matmul_rowint(
    const uint4* __restrict__ pw, const int* __restrict__ sw, const uint2* __restrict__ px,
    const int* __restrict__ sx, float* __restrict__ y, int M, int N, int K) {
    __shared__ long long part[RI_WARPS][16][RI_NT * 8];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, KS = K >> 5, rt0 = blockIdx.y * RI_RW;
    int tt0 = blockIdx.x * RI_NT, nt = min(RI_NT, ((M + 7) >> 3) - tt0);
    int k0 = w * KS / RI_WARPS, k1 = (w + 1) * KS / RI_WARPS;
    bx_pdl_wait();
    int acc[RI_RW][RI_NT][4][4];
#pragma unroll
    for (int r = 0; r < RI_RW; ++r)
#pragma unroll
        for (int t = 0; t < RI_NT; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][t][j][i] = 0;
    const uint4* wp[RI_RW];
#pragma unroll
    for (int r = 0; r < RI_RW; ++r)  // a tile past the matrix reads the last one (its outputs are not stored)
        wp[r] = pw + (size_t)min(rt0 + r, N / 16 - 1) * KS * 2 * 32 + lane;
#pragma unroll 4
    for (int kk = k0; kk < k1; ++kk) {
        unsigned int al[RI_RW][4], ah[RI_RW][4];
#pragma unroll
        for (int r = 0; r < RI_RW; ++r) {
            uint4 wl = bx_ld_stream(wp[r] + (size_t)kk * 64), wh = bx_ld_stream(wp[r] + (size_t)kk * 64 + 32);
            al[r][0] = wl.x, al[r][1] = wl.y, al[r][2] = wl.z, al[r][3] = wl.w;
            ah[r][0] = wh.x, ah[r][1] = wh.y, ah[r][2] = wh.z, ah[r][3] = wh.w;
        }
#pragma unroll
        for (int t = 0; t < RI_NT; ++t) {
            if (t >= nt) break;
            const uint2* xp = px + ((size_t)((tt0 + t) * KS + kk) * 3) * 32 + lane;
            uint2 xl = __ldg(xp), xm = __ldg(xp + 32), xh = __ldg(xp + 64);
#pragma unroll
            for (int r = 0; r < RI_RW; ++r) {
                bx_mma_s8_acc(al[r], xl.x, xl.y, acc[r][t][0]);  // 2^0
                bx_mma_s8_acc(al[r], xm.x, xm.y, acc[r][t][1]);  // 2^7
                bx_mma_s8_acc(ah[r], xl.x, xl.y, acc[r][t][1]);
                bx_mma_s8_acc(al[r], xh.x, xh.y, acc[r][t][2]);  // 2^14
                bx_mma_s8_acc(ah[r], xm.x, xm.y, acc[r][t][2]);
                bx_mma_s8_acc(ah[r], xh.x, xh.y, acc[r][t][3]);  // 2^21
            }
        }
    }
    int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int r = 0; r < RI_RW; ++r) {  // the warps' partials of row tile r meet in shared memory
        if (r) __syncthreads();
#pragma unroll
        for (int t = 0; t < RI_NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                part[w][gid + 8 * (i >> 1)][8 * t + 2 * tig + (i & 1)] =
                    (long long)acc[r][t][0][i] + ((long long)acc[r][t][1][i] << 7) +
                    ((long long)acc[r][t][2][i] << 14) + ((long long)acc[r][t][3][i] << 21);
        __syncthreads();
        for (int o = threadIdx.x; o < 16 * RI_NT * 8; o += blockDim.x) {
            int rr = o / (RI_NT * 8), c = o % (RI_NT * 8), m = tt0 * 8 + c, n = (rt0 + r) * 16 + rr;
            if (m >= M || n >= N) continue;
            long long I = 0;
#pragma unroll
            for (int v = 0; v < RI_WARPS; ++v) I += part[v][rr][c];
            int e = sx[m] + sw[n];  // |e| < 1022: 2^e is a normal double
            y[(size_t)m * N + n] = __double2float_rn((double)I * __longlong_as_double((long long)(1023 + e) << 52));
        }
    }
}
