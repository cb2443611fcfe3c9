// bitexact: matrix products (docs/determinism.md sections 5 and 14).
// Kernels: quantize_q8, matmul_q, lane_major, matmul_f, quantize_rowint,
// matmul_rowint. Launchers with shape checks: node/backend_cuda.py
// (launch_quantize_q8, launch_matmul_q, launch_lane_major, launch_matmul_f,
// launch_quantize_rowint, launch_matmul_rowint), in the same order. Twins:
// node/reference.py quantize_q8, matmul_q, lane_major, matmul_f,
// quantize_rowint, matmul_rowint. matmul_q
// takes a residual r0 for its first matrix (nullptr: none) and writes
// y0 = r0 + product, the twin of reference.residual_add after the product.
#include "common.cuh"

// ---- quantize_q8: one warp per 32-element block of one token ----------------
extern "C" __global__ void quantize_q8(const float* __restrict__ x, signed char* __restrict__ q,
                                       float* __restrict__ d, int* __restrict__ a, int M, int K) {
    bx_pdl_wait();
    int nb = K >> 5;
    long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (gw >= (long long)M * nb) return;  // uniform per warp
    size_t e = (size_t)gw * 32 + lane;  // block gw = m * nb + b holds elements m * K + 32b ..
    bx_quantize_block(x[e], lane, q + e, d + gw, a + gw);
}

// ---- matmul_q: int8 tensor-core MMA per block, the contract's fold per output
// A tile is MQ_ROWS = 16 output rows by MQ_TT = 8 * MQ_NT tokens, one block of
// `split` warps (2, 4 or 8, chosen by the launcher from the matrices' rows and
// the lanes of K, so that each warp owns whole groups of MQ_SLOTS lanes); warp
// s walks the blocks of contract lanes s*lw .. s*lw+lw-1 (lw = lanes / split).
// For each 32-element block b, one mma.sync
// m16n8k32 (s8 x s8 -> s32) per 8 tokens gives the exact integer I_b of 16 x 8
// outputs (integer sums are order-free). Thread (gid = lane >> 2, c = lane & 3)
// owns the MMAs' C elements (rows gid and gid + 8, tokens 8t + 2c and 8t + 2c + 1) and
// folds r_b into them in ascending b: the running sum of contract lane L's
// range (blocks L*g .. L*g+g-1). When a range ends its value joins a binary
// counter over the lane's group of MQ_SLOTS lanes, and a complete group's
// subtree goes to a shared-memory slot; the tree over the slots then adds
// neighbours first exactly as warp_sum's xor-butterfly does (fp32 addition
// is commutative). A tensor-parallel shard
// (docs/determinism.md section 12) is the same walk over its `lanes` contract
// lanes of nbs blocks, and x's block is blk0 + b. Up to three matrices with
// the same K (Q/K/V, gate/up) in one launch; grid x walks token tiles so a row
// tile's token tiles run together.
// Weights come as records (node/backend_cuda.py pack_q): tile t's block b is
// record t * nbs + b, the A fragments of its 16 rows in the order the threads
// read them, then each row's scale and offset (Q6_K: sub-block scales), so a
// warp's blocks are one contiguous span. A warp copies one unit (up to 8
// records, and its 8 tokens' codes, d and a of those blocks) into shared
// memory with cp.async, double-buffered, so the next unit streams in while
// this one is computed. MMA k-slot order is free as long as A and B agree:
// thread c's k-slots 4c..4c+3 and 16+4c..16+4c+3 hold the block's elements 8c..8c+7.
#define MQ_TM 8     // tokens per warp of matmul_f
#define MQ_ROWS 16  // output rows per tile (the MMA's M)
#define MQ_UNIT 8   // records per staged unit
// Tile constants (none changes any sum; scripts/tune_matmul.py times variants).
// A warp's lanes are whole groups: split is 2, 4 or 8 and at most lanes / MQ_SLOTS (launcher).
#ifndef MQ_NT
#define MQ_NT 1     // MMAs of 8 tokens per tile
#endif
#ifndef MQ_PF
#define MQ_PF 4096  // bytes of a warp's first records hinted into L2 before the previous kernel ends
#endif
#ifndef MQ_SLOTS
#define MQ_SLOTS 2  // contract lanes per shared-memory slot: 1, 2 or 4 (node/backend_cuda.py MQ_SLOTS)
#endif
static_assert(MQ_SLOTS == 1 || MQ_SLOTS == 2 || MQ_SLOTS == 4, "bx_group_push holds two counter levels");
#define MQ_TT (8 * MQ_NT)                  // tokens per tile
#define MQ_NV (4 * MQ_NT)                  // C elements per thread

// 4-bit codes (two per byte) or int8 codes in a record (node/backend_cuda.py MQ_NIBBLES).
__host__ __device__ constexpr bool bx_mq_nibbles(int qt) { return qt == BX_Q4_0 || qt == BX_Q4_1 || qt == BX_Q4_K; }
// Bytes of a record: A fragments (16 rows x 32 codes), then 8 x 16 bytes of scale words.
__host__ __device__ constexpr int bx_mq_rec(int qt) { return (bx_mq_nibbles(qt) ? 256 : 512) + 128; }
// Bytes of one stage: a unit of records, then 8 tokens' codes, d and a of its 8 blocks.
__host__ __device__ constexpr int bx_mq_stage(int qt) {
    return MQ_UNIT * bx_mq_rec(qt) + MQ_TT * 8 * 32 + 2 * MQ_TT * 8 * 4;
}
// Per warp: two stages. A slot holds MQ_NV values per thread for MQ_SLOTS contract lanes.
__host__ __device__ constexpr int bx_mq_warp_bytes(int qt) { return 2 * bx_mq_stage(qt); }
// Read by node/backend_cuda.py: dynamic shared memory = split * bx_mq_warp_smem[weight type id]
// (the largest over a launch's types) + lanes * bx_mq_lane_smem; tokens per tile.
extern "C" __constant__ int bx_mq_warp_smem[8] = {0, 0, 0, bx_mq_warp_bytes(BX_Q8_0), bx_mq_warp_bytes(BX_Q4_0),
                                                  bx_mq_warp_bytes(BX_Q4_1), bx_mq_warp_bytes(BX_Q4_K),
                                                  bx_mq_warp_bytes(BX_Q6_K)};
extern "C" __constant__ int bx_mq_tokens = MQ_TT;
extern "C" __constant__ int bx_mq_lane_smem = MQ_NV * 32 * 4 / MQ_SLOTS;

// C[16 x 8] (s32) = A[16 x 32] (s8, rows) * B[32 x 8] (s8, columns), one warp.
__device__ __forceinline__ void bx_mma_s8(const unsigned int* a, unsigned int b0, unsigned int b1, int* d) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %10, %10, %10};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void bx_cp_async(void* smem, const void* gmem, int bytes) {
    unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem));
}

// The value v[i] of the lane at position j of its group joins the counter st
// (levels 0 .. log2(MQ_SLOTS) - 1); after the group's last lane (j = MQ_SLOTS -
// 1) v holds the group's subtree and the function returns true.
__device__ __forceinline__ bool bx_group_push(float (&st)[2][MQ_NV], float (&v)[MQ_NV], int j) {
    bool carry = true;
#pragma unroll
    for (int k = 0; (1 << k) < MQ_SLOTS; ++k) {
        if (carry) {
            if ((j >> k) & 1) {
#pragma unroll
                for (int i = 0; i < MQ_NV; ++i) v[i] = __fadd_rn(st[k][i], v[i]);
            } else {
#pragma unroll
                for (int i = 0; i < MQ_NV; ++i) st[k][i] = v[i];
                carry = false;
            }
        }
    }
    return carry;
}

// One warp's share of a tile: see the kernel's comment. Wt: the tile's first
// record; smem: the block's dynamic shared memory (each warp's two stages,
// then the slots of the shard's lanes / MQ_SLOTS groups).
template <int QT>
__device__ __forceinline__ void bx_matmul_q_warp(const unsigned char* __restrict__ Wt, float* __restrict__ y,
                                                 const float* __restrict__ r, int n0, int N,
                                                 const signed char* __restrict__ xq, const float* __restrict__ xd,
                                                 const int* __restrict__ xa, int M, int m0, int K, int g, int lanes,
                                                 int blk0, int nbs, int split, unsigned char* smem) {
    constexpr bool NEED_A = QT != BX_Q8_0 && QT != BX_Q6_K;  // the offset term, or Q4_0's I = I(q) - 8a
    constexpr int REC = bx_mq_rec(QT), CODES = REC - 128, STAGE = bx_mq_stage(QT);
    int lane = threadIdx.x & 31, gid = lane >> 2, c = lane & 3, wi = threadIdx.x >> 5;
    int nb = K >> 5;
    int lw = lanes / split, l0 = wi * lw, l = l0;           // this warp's contract lanes l0 .. l0 + lw - 1
    unsigned char* stage = smem + wi * 2 * STAGE;
    float(*slot)[MQ_NV][32] = (float(*)[MQ_NV][32])(smem + split * 2 * STAGE);  // slot s: lanes MQ_SLOTS*s ..
    int b_lo = min(l0 * g, nbs), b_hi = min((l0 + lw) * g, nbs);
    int n_units = (b_hi - b_lo + MQ_UNIT - 1) / MQ_UNIT;    // unit u: blocks b_lo + 8u .. (at most 8)
    const unsigned char* Wb = Wt + (size_t)b_lo * REC;     // the warp's records, one span
    // While the previous kernel runs: the warp's first MQ_PF bytes of records into L2.
    for (int i = lane; i < MQ_PF / 128; i += 32)
        if (i * 128 < (b_hi - b_lo) * REC) bx_prefetch_l2(Wb + i * 128);
    bx_pdl_wait();

    // Issue the copies of unit u into stage buffer `buf`.
    auto issue = [&](int u, int buf) {
        unsigned char* sw = stage + buf * STAGE;
        unsigned char* sq = sw + MQ_UNIT * REC;
        float* sd = (float*)(sq + MQ_TT * 8 * 32);
        int* sa = (int*)(sd + MQ_TT * 8);
        int nbu = min(MQ_UNIT, b_hi - b_lo - MQ_UNIT * u);  // the unit's blocks
        const unsigned char* src = Wb + (size_t)u * MQ_UNIT * REC;
#pragma unroll
        for (int k = 0; k < MQ_UNIT * REC / 16 / 32; ++k) {
            int i = lane + 32 * k;
            if (i < nbu * (REC / 16)) bx_cp_async(sw + 16 * i, src + 16 * i, 16);
        }
        // x: the codes, d and a of 8 tokens for those blocks (dead tokens read token M-1); lane's chunk
        // i = lane + 32k is token i >> 4, block (i >> 1) & 7, half i & 1 of the codes, and token (i >> 3) & 7,
        // block i & 7 of d (i < 64) or a.
        int xb = blk0 + b_lo + MQ_UNIT * u;  // x's block of the unit's block 0
#pragma unroll
        for (int k = 0; k < MQ_TT * 8 * 2 / 32; ++k) {
            int i = lane + 32 * k, t = i >> 4, bi = (i >> 1) & 7;
            if (bi < nbu)
                bx_cp_async(sq + 16 * i, xq + (size_t)min(m0 + t, M - 1) * K + 32 * xb + 16 * (i & 15), 16);
        }
#pragma unroll
        for (int k = 0; k < MQ_TT * 8 * 2 / 32; ++k) {
            int i = lane + 32 * k, t = (i >> 3) % MQ_TT, bi = i & 7;
            size_t src = (size_t)min(m0 + t, M - 1) * nb + xb + bi;
            if (bi < nbu) {
                if (i < MQ_TT * 8) bx_cp_async(sd + (i & (MQ_TT * 8 - 1)), xd + src, 4);
                else if (NEED_A) bx_cp_async(sa + (i & (MQ_TT * 8 - 1)), xa + src, 4);
            }
        }
        asm volatile("cp.async.commit_group;");
    };

    // C element 4t + j: row gid + 8 * (j >> 1), token m0 + 8t + 2c + (j & 1)
    float acc[MQ_NV], st[2][MQ_NV];
#pragma unroll
    for (int i = 0; i < MQ_NV; ++i) acc[i] = 0.0f;
    int live_nt = min(MQ_NT, (M - m0 + 7) / 8);  // MMAs with a live token
    if (n_units > 0) issue(0, 0);
    for (int u = 0; u < n_units; ++u) {
        if (u + 1 < n_units) {
            issue(u + 1, (u + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncwarp();
        const unsigned char* sw = stage + (u & 1) * STAGE;
        const unsigned char* sq = sw + MQ_UNIT * REC;
        const float* sd = (const float*)(sq + MQ_TT * 8 * 32);
        const int* sa = (const int*)(sd + MQ_TT * 8);
        int nbu = min(MQ_UNIT, b_hi - b_lo - MQ_UNIT * u);
#pragma unroll
        for (int bi = 0; bi < MQ_UNIT; ++bi) {
            if (bi >= nbu) break;
            const unsigned char* rec = sw + bi * REC;
            unsigned int wa[4];  // A fragments: rows gid, gid + 8 x elements 8c..8c+3, then 8c+4..8c+7
            if (bx_mq_nibbles(QT)) {
                uint2 p = *(const uint2*)(rec + 8 * lane);
                wa[0] = p.x & 0x0F0F0F0Fu;
                wa[1] = p.y & 0x0F0F0F0Fu;
                wa[2] = (p.x >> 4) & 0x0F0F0F0Fu;
                wa[3] = (p.y >> 4) & 0x0F0F0F0Fu;
            } else {
                uint4 p = *(const uint4*)(rec + 16 * lane);
                wa[0] = p.x; wa[1] = p.y; wa[2] = p.z; wa[3] = p.w;
            }
            float4 sc = *(const float4*)(rec + CODES + 16 * gid);  // rows gid, gid + 8: scales, offsets
#pragma unroll
            for (int t = 0; t < MQ_NT; ++t) {
                if (t >= live_nt) break;
                uint2 bx = *(const uint2*)(sq + ((8 * t + gid) * 8 + bi) * 32 + 8 * c);
                int isum[4];
                if (QT == BX_Q6_K) {  // two MMAs: elements 0..15 (threads c < 2) and 16..31 (c >= 2)
                    unsigned int z = 0u, a[4];
                    bool first = c < 2;
#pragma unroll
                    for (int j = 0; j < 4; ++j) a[j] = first ? wa[j] : z;
                    int ia[4], ib[4];
                    bx_mma_s8(a, bx.x, bx.y, ia);
#pragma unroll
                    for (int j = 0; j < 4; ++j) a[j] = first ? z : wa[j];
                    bx_mma_s8(a, bx.x, bx.y, ib);
                    // ia, ib: rows (gid, gid, gid+8, gid+8); each row's own sub-block scales (int16 pairs)
                    int s0 = __float_as_int(sc.z), s1 = __float_as_int(sc.w);
                    int a0 = (short)(s0 & 0xFFFF), b0 = s0 >> 16, a1 = (short)(s1 & 0xFFFF), b1 = s1 >> 16;
                    isum[0] = a0 * ia[0] + b0 * ib[0];
                    isum[1] = a0 * ia[1] + b0 * ib[1];
                    isum[2] = a1 * ia[2] + b1 * ib[2];
                    isum[3] = a1 * ia[3] + b1 * ib[3];
                } else {
                    bx_mma_s8(wa, bx.x, bx.y, isum);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {  // dead tokens' sums are never written
                    int tk = 8 * t + 2 * c + (j & 1);
                    float s = j < 2 ? sc.x : sc.y, da = sd[tk * 8 + bi];
                    if (QT == BX_Q4_0) isum[j] -= 8 * sa[tk * 8 + bi];  // codes stored as q = code + 8
                    float rb = __fmul_rn(__fmul_rn(s, da), (float)isum[j]);
                    if (QT == BX_Q4_1 || QT == BX_Q4_K) {
                        float o = j < 2 ? sc.z : sc.w;
                        rb = __fadd_rn(rb, __fmul_rn(__fmul_rn(o, da), (float)sa[tk * 8 + bi]));
                    }
                    acc[4 * t + j] = __fadd_rn(acc[4 * t + j], rb);
                }
            }
            int b = b_lo + MQ_UNIT * u + bi;
            if (b + 1 == (l + 1) * g || b + 1 == nbs) {  // lane l's range is complete
                if (bx_group_push(st, acc, l & (MQ_SLOTS - 1))) {
#pragma unroll
                    for (int i = 0; i < MQ_NV; ++i) slot[l / MQ_SLOTS][i][lane] = acc[i];
                }
                ++l;
#pragma unroll
                for (int i = 0; i < MQ_NV; ++i) acc[i] = 0.0f;
            }
        }
        __syncwarp();  // the buffer is refilled by the next issue
    }
    for (; l < l0 + lw; ++l) {  // lanes that own no block hold +0.0
        float z[MQ_NV];
#pragma unroll
        for (int i = 0; i < MQ_NV; ++i) z[i] = 0.0f;
        if (bx_group_push(st, z, l & (MQ_SLOTS - 1))) {
#pragma unroll
            for (int i = 0; i < MQ_NV; ++i) slot[l / MQ_SLOTS][i][lane] = z[i];
        }
    }
    __syncthreads();
    for (int i = wi; i < MQ_NV; i += split) {  // the tree over the slots, neighbours first
        constexpr int S = 32 / MQ_SLOTS;
        int ns = lanes / MQ_SLOTS;
        float v[S];
#pragma unroll
        for (int k = 0; k < S; ++k) v[k] = k < ns ? slot[k][i][lane] : 0.0f;
        float sum = ns == S ? bx_tree<S>(v) : ns == S / 2 ? bx_tree<S / 2>(v) : ns == S / 4 ? bx_tree<S / 4>(v)
                                                                            : bx_tree<S / 8>(v);
        int n = n0 + gid + 8 * ((i >> 1) & 1), m = m0 + 8 * (i >> 2) + 2 * c + (i & 1);
        size_t o = (size_t)m * N + n;
        if (n < N && m < M) y[o] = r ? __fadd_rn(r[o], sum) : sum;  // the residual add, fused
    }
}

extern "C" __global__ void __launch_bounds__(256, 1)  // (256) alone lets ptxas spill at 80 registers
matmul_q(const unsigned char* __restrict__ W0, const unsigned char* __restrict__ W1,
         const unsigned char* __restrict__ W2, float* __restrict__ y0, float* __restrict__ y1,
         float* __restrict__ y2, const float* __restrict__ r0, int N0, int N1, int N2, int qt0, int qt1, int qt2,
         const signed char* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xa, int M, int K,
         int g, int lanes, int blk0, int nbs, int split) {
    extern __shared__ __align__(16) unsigned char bx_smem[];  // split * bx_mq_warp_smem[qtype] + lanes * bx_mq_lane_smem
    int w = blockIdx.y;  // the row tile, over the matrices' tiles
    int w0 = (N0 + MQ_ROWS - 1) / MQ_ROWS, w1 = (N1 + MQ_ROWS - 1) / MQ_ROWS, w2 = (N2 + MQ_ROWS - 1) / MQ_ROWS;
    const unsigned char* W = W0;
    float* y = y0;
    const float* r = r0;
    int N = N0, qtype = qt0;
    if (w >= w0) {
        w -= w0;
        W = W1; y = y1; r = nullptr; N = N1; qtype = qt1;
        if (w >= w1) {
            w -= w1;
            W = W2; y = y2; N = N2; qtype = qt2;
            if (w >= w2) {  // uniform per block
                bx_pdl_wait();
                return;
            }
        }
    }
    int m0 = blockIdx.x * MQ_TT;
    size_t tile = (size_t)w * nbs;  // the tile's first record
#define BX_MQ(QT) bx_matmul_q_warp<QT>(W + tile * bx_mq_rec(QT), y, r, w * MQ_ROWS, N, xq, xd, xa, M, m0, K, g, \
                                       lanes, blk0, nbs, split, bx_smem)
    if (qtype == BX_Q8_0) BX_MQ(BX_Q8_0);
    else if (qtype == BX_Q4_0) BX_MQ(BX_Q4_0);
    else if (qtype == BX_Q4_1) BX_MQ(BX_Q4_1);
    else if (qtype == BX_Q4_K) BX_MQ(BX_Q4_K);
    else BX_MQ(BX_Q6_K);
#undef BX_MQ
}

// ---- lane_major: x [M, K] -> the lane-major layout matmul_f reads ----------
// Element (l, j, e) = x[m, l*g + j*V + e] moves to (j*32 + l)*V + e, g = K/32.
// A pure permutation. Twin: node/reference.py lane_major.
extern "C" __global__ void lane_major(const float* __restrict__ x, float* __restrict__ xl, int M, int K, int V) {
    bx_pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * K) return;
    int m = (int)(i / K), c = (int)(i % K);
    int e = c % V, l = (c / V) & 31, j = c / (32 * V);
    xl[i] = x[(size_t)m * K + (size_t)l * (K >> 5) + j * V + e];
}

// ---- matmul_f: F32/F16/BF16 weights, fp32 products, warp_sum over K ---------
// Weights are lane-major (node/reference.py lane_major) with chunks of V
// elements (16 bytes where K allows) and x with chunks of XV = min(V, 4) fp32
// elements (16 bytes when XV = 4; node/backend_cuda.py x_width), so at step j
// the warp reads its 32 lanes' chunks as contiguous 512-byte spans (coalesced,
// no L1 line read twice; with x in chunks of V = 8 each 16-byte load of a warp
// spanned 1 KB), yet lane l still adds the products of k = l*g .. l*g+g-1 one
// by one in ascending k, then the butterfly: the contract's warp_sum.
// One warp per MF_ROWS output rows (each x chunk loaded once for all of them),
// MQ_TM tokens per warp; up to three matrices with the same K and type
// (Q/K/V, gate/up) in one launch, each starting at a warp of its own.
// A tensor-parallel shard of K (docs/determinism.md section 12) is computed
// by sub-warps of `lanes` lanes (32/lanes sub-warps, MF_ROWS rows each): the
// weight rows hold the shard's lanes only, lane-major over `lanes` lanes
// (chunk j*lanes + l), sub-lane l reads x's chunks (j*V/XV + h)*32 + lane0 + l
// (h < V/XV), and the lowest log2(lanes) butterfly levels give the shard's partial.
// Tile constants, chosen by timing variants on one NVIDIA H200 over the 8B
// shapes at batch 1, 8 and 32 (scripts/tune_matmul.py compiles variants with
// -D; docs/benchmarks.md); none changes any sum. The node compiles the defaults.
#ifndef MF_WARPS
#define MF_WARPS 8   // warps per block (node/backend_cuda.py MF_WARPS)
#endif
#ifndef MF_ROWS
#define MF_ROWS 2    // output rows per warp (node/backend_cuda.py MF_ROWS)
#endif
#ifndef MF_BYTES
#define MF_BYTES 16  // weight bytes in flight per lane and row
#endif
#ifndef MF_MINB
#define MF_MINB 4    // __launch_bounds__ minimum blocks per SM (<= 64 registers)
#endif
#ifndef MF_PF
#define MF_PF 2048   // bytes per weight row hinted into L2 before the previous kernel ends
#endif

template <int WT, int V>
__device__ __forceinline__ void bx_decode_chunk(const unsigned int* u, float* w) {
    if (WT == BX_F32) {
#pragma unroll
        for (int i = 0; i < V; ++i) w[i] = __uint_as_float(u[i]);
    } else if (V == 1) {
        unsigned short h = (unsigned short)(u[0] & 0xFFFFu);
        w[0] = WT == BX_F16 ? bx_half(h) : bx_bf16(h);
    } else {
#pragma unroll
        for (int i = 0; i < V / 2; ++i) {
            unsigned short lo = (unsigned short)(u[i] & 0xFFFFu), hi = (unsigned short)(u[i] >> 16);
            w[2 * i] = WT == BX_F16 ? bx_half(lo) : bx_bf16(lo);
            w[2 * i + 1] = WT == BX_F16 ? bx_half(hi) : bx_bf16(hi);
        }
    }
}

// Chunk of V elements of WT: CB bytes, loaded as NW 32-bit words (or one 16-bit).
// Weights are read once per launch, so they bypass L1 (L1::no_allocate) and
// leave it to the x chunks every warp of the SM reads: measured on one NVIDIA
// H200 (docs/benchmarks.md, "Twentieth session"), 8B BF16 down at batch 8
// 194 -> 110 us, the 4-layer step 2.83 -> 2.18 ms at batch 8; the same bytes.
template <int WT, int V>
struct BxChunk {
    static constexpr int CB = V * (WT == BX_F32 ? 4 : 2);
    static constexpr int NW = CB >= 4 ? CB / 4 : 1;
    static constexpr int U = CB >= 8 && MF_BYTES >= CB ? MF_BYTES / CB : (CB >= 8 ? 1 : 8);  // chunks in flight
    unsigned int u[NW];
    __device__ __forceinline__ void load(const unsigned char* __restrict__ row, int idx) {
        const unsigned char* p = row + (size_t)idx * CB;
        if (CB == 16) {
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "l"(p));
        } else if (CB == 8) {
            asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(u[0]), "=r"(u[1]) : "l"(p));
        } else if (CB == 4) {
            asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(u[0]) : "l"(p));
        } else {
            u[0] = *(const unsigned short*)p;
        }
    }
};

template <int V>
__device__ __forceinline__ void bx_load_x(const float* __restrict__ p, float* xv) {
    if (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 4) {
            float4 f = *(const float4*)(p + i);
            xv[i] = f.x; xv[i + 1] = f.y; xv[i + 2] = f.z; xv[i + 3] = f.w;
        }
    } else if (V == 2) {
        float2 f = *(const float2*)p;
        xv[0] = f.x; xv[1] = f.y;
    } else {
        xv[0] = p[0];
    }
}

// Rows n0 + sub*MF_ROWS .. of W for sub-warp sub (rows past N read row N-1 and are not written).
template <int WT, int V, int LANES>
__device__ __forceinline__ void bx_matmul_f_rows(const unsigned char* __restrict__ W, const float* __restrict__ xl,
                                                 float* __restrict__ y, int n0, int N, int M, int m0, int K,
                                                 int lane, int lane0) {
    constexpr int lanes = LANES;
    constexpr int XV = V < 4 ? V : 4;  // x's chunk: at most 16 bytes (node/backend_cuda.py x_width)
    using C = BxChunk<WT, V>;
    int sub = lane / lanes, l = lane & (lanes - 1);
    n0 += sub * MF_ROWS;
    const unsigned char* rows[MF_ROWS];
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
        rows[r] = W + (size_t)min(n0 + r, N - 1) * (lanes * (K >> 5)) * (WT == BX_F32 ? 4 : 2);
    int nj = (K >> 5) / V;
    int xlane = lane0 + l;  // the contract lane whose x chunks this sub-lane reads
    float acc[MF_ROWS][MQ_TM];
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) acc[r][t] = 0.0f;
    for (int j0 = 0; j0 < nj; j0 += C::U) {
        C w[MF_ROWS][C::U];
#pragma unroll
        for (int u = 0; u < C::U; ++u)
#pragma unroll
            for (int r = 0; r < MF_ROWS; ++r)
                if (j0 + u < nj) w[r][u].load(rows[r], (j0 + u) * lanes + l);
#pragma unroll
        for (int u = 0; u < C::U; ++u) {
            if (j0 + u >= nj) break;
            asm volatile("" ::: "memory");  // keep x loads per chunk: bounds registers
            float wf[MF_ROWS][V];
#pragma unroll
            for (int r = 0; r < MF_ROWS; ++r) bx_decode_chunk<WT, V>(w[r][u].u, wf[r]);
#pragma unroll
            for (int t = 0; t < MQ_TM; ++t) {
                if (m0 + t >= M) break;
                float xv[V];
#pragma unroll
                for (int h = 0; h < V / XV; ++h)
                    bx_load_x<XV>(xl + (size_t)(m0 + t) * K + (size_t)(((j0 + u) * (V / XV) + h) * 32 + xlane) * XV,
                                  xv + h * XV);
#pragma unroll
                for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[r][t] = __fadd_rn(acc[r][t], __fmul_rn(xv[e], wf[r][e]));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MF_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MQ_TM; ++t) {
            float v = bx_butterfly_lanes(acc[r][t], LANES);
            if (l == 0 && m0 + t < M && n0 + r < N) y[(size_t)(m0 + t) * N + n0 + r] = v;
        }
}

// Not inlined: with every (type, lanes) body inlined into one kernel the
// register allocator spills; as calls each body gets the registers alone.
template <int WT, int LANES>
__device__ __noinline__ void bx_matmul_f_v(int V, const unsigned char* W, const float* xl, float* y, int n0,
                                              int N, int M, int m0, int K, int lane, int lane0) {
    if (V == 8) bx_matmul_f_rows<WT, (WT == BX_F32 ? 4 : 8), LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (V == 4) bx_matmul_f_rows<WT, 4, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (V == 2) bx_matmul_f_rows<WT, 2, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
    else bx_matmul_f_rows<WT, 1, LANES>(W, xl, y, n0, N, M, m0, K, lane, lane0);
}

// The shard's lane count as a template argument, so the full warp's code is unchanged.
template <int WT>
__device__ __forceinline__ void bx_matmul_f_t(int V, const unsigned char* W, const float* xl, float* y, int n0,
                                              int N, int M, int m0, int K, int lane, int lanes, int lane0) {
    if (lanes == 32) bx_matmul_f_v<WT, 32>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (lanes == 16) bx_matmul_f_v<WT, 16>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else if (lanes == 8) bx_matmul_f_v<WT, 8>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
    else bx_matmul_f_v<WT, 4>(V, W, xl, y, n0, N, M, m0, K, lane, lane0);
}

extern "C" __global__ void __launch_bounds__(32 * MF_WARPS, MF_MINB)
matmul_f(const unsigned char* __restrict__ W0, const unsigned char* __restrict__ W1,
         const unsigned char* __restrict__ W2, float* __restrict__ y0, float* __restrict__ y1,
         float* __restrict__ y2, int N0, int N1, int N2, int wtype, int V, const float* __restrict__ xl, int M,
         int K, int lanes, int lane0) {
    int lane = threadIdx.x & 31;
    int w = blockIdx.y * MF_WARPS + (threadIdx.x >> 5);  // warp index over the matrices' warps
    int per = MF_ROWS * (32 / lanes);                     // rows per warp
    int w0 = (N0 + per - 1) / per, w1 = (N1 + per - 1) / per, w2 = (N2 + per - 1) / per;
    const unsigned char* W = W0;
    float* y = y0;
    int N = N0;
    bool live = true;
    if (w >= w0) {
        w -= w0;
        W = W1; y = y1; N = N1;
        if (w >= w1) {
            w -= w1;
            W = W2; y = y2; N = N2;
            live = w < w2;  // uniform per warp
        }
    }
    if (live) {  // while the previous kernel runs: the first MF_PF bytes of each of the warp's rows into L2
        int row_bytes = lanes * (K >> 5) * (wtype == BX_F32 ? 4 : 2);
        for (int r = 0; r < per; ++r)
            for (int o = lane * 128; o < min(MF_PF, row_bytes); o += 32 * 128)
                bx_prefetch_l2(W + (size_t)min(w * per + r, N - 1) * row_bytes + o);
    }
    bx_pdl_wait();
    if (!live) return;
    int m0 = blockIdx.x * MQ_TM;
    if (wtype == BX_F32) bx_matmul_f_t<BX_F32>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
    else if (wtype == BX_F16) bx_matmul_f_t<BX_F16>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
    else bx_matmul_f_t<BX_BF16>(V, W, xl, y, w * per, N, M, m0, K, lane, lanes, lane0);
}

// ---- contract 2 (docs/determinism.md section 14): float weights in exact integers ----
// y[m, n] = fp32_rn(I * 2^(sx[m] + sw[n])) with the exact integer I = sum_k cx[m, k] cw[n, k].
// Weight codes (|cw| <= 2^13) are two int8 slices, cw = 128 wh + wl (wl in 0..127);
// input codes (|cx| <= 2^20) three, cx = 2^14 xh + 2^7 xm + xl. Slice products of one
// weight 2^(7j) share an int32 accumulator (j = 0 .. 3), each below 2^31 for K < 2^16
// (the launcher's check), so every MMA sum is exact and any split of K or of the tokens
// gives the same I. Both operands are laid out in memory as wgmma reads them from shared
// memory (K-major core matrices of 8 rows x 16 bytes, no swizzle; node/backend_cuda.py
// pack_rowint_w and pack_rowint_x): weights per 64-row group rg, k-step kk (32 elements)
// and slice s as 2048 bytes, row r and element e at (r / 8) 256 + (e / 16) 128 +
// (r % 8) 16 + e % 16 (record (rg * KS + kk) * 2 + s, rows past N zero); inputs per 8-token
// tile tt, k-step and slice as 256 bytes, token t at (e / 16) 128 + 16 t + e % 16 (record
// (tt * KS + kk) * 3 + s, tokens past M zero). A row with a value that is not finite has
// exponent RI_NONFINITE and zero codes; its outputs are NaN (a fault).
#ifndef RI_S
#define RI_S 4           // blocks per cluster: block r adds k-steps [r KS / RI_S, (r + 1) KS / RI_S)
#endif
#define RI_NT 4          // 8-token tiles per pass (32 tokens; wgmma N is 8 x the pass's live tiles)
#ifndef RI_CH
#define RI_CH 4          // k-steps per shared-memory stage
#endif
#ifndef RI_STAGES
#define RI_STAGES 2      // stages in the ring (RI_STAGES - 1 in flight while one is read)
#endif
#define RI_QT 512        // quantize_rowint's threads per token
#define RI_XBITS 19      // node/reference.py X_CODE_BITS
#define RI_NONFINITE (1 << 30)  // node/reference.py ROWINT_NONFINITE
#define RI_WREC 2048                    // weight bytes of one group, k-step and slice
#define RI_XREC (RI_NT * 256)           // input bytes of one pass, k-step and slice in a stage
#define RI_STAGE (RI_CH * (2 * RI_WREC + 3 * RI_XREC))  // bytes of one stage: weights, then inputs
// matmul_rowint's tokens per pass, rows per cluster, blocks per cluster, threads per block
// (one warpgroup) and dynamic shared memory bytes per block, quantize_rowint's threads, and
// RI_NONFINITE: read by node/backend_cuda.py rowint_geometry
extern "C" __constant__ int bx_ri_geometry[7] = {RI_NT * 8, 64, RI_S, 128, RI_STAGES * RI_STAGE, RI_QT, RI_NONFINITE};
static_assert(RI_STAGES >= 2 && RI_CH >= 1, "a ring of at least two stages");
static_assert(RI_STAGES * RI_STAGE >= 64 * RI_NT * 8 * 8, "the stages must hold a block's int64 partials");
static_assert(RI_STAGES * RI_STAGE <= 227 * 1024, "shared memory of one block on sm_90");

// wgmma descriptor of a K-major, unswizzled operand at shared address a (the weights, A,
// and the input codes, B, alike): core matrices of 8 rows (or tokens) x 16 bytes, the two
// k-halves 128 bytes apart, successive 8-row (8-token) groups 256 (PTX ISA, "Matrix
// Descriptor Format": start, leading and stride byte offsets in 16-byte units).
__device__ __forceinline__ unsigned long long bx_ri_desc(unsigned int a) {
    return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16) |
           ((unsigned long long)(256 >> 4) << 32);
}

// D[64 x 8 NT] (s32) += A[64 x 32] (s8) * B[32 x 8 NT] (s8), both in shared memory
// (descriptors), one warpgroup; exact. Asynchronous: the caller fences, commits and waits
// (PTX ISA wgmma.mma_async).
template <int NT> __device__ __forceinline__ void bx_wgmma_s8(int* d, unsigned long long a, unsigned long long b);
#define BX_WG_AB "l"(a), "l"(b), "r"(1)
#define BX_WG_D4(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3])
template <> __device__ __forceinline__ void bx_wgmma_s8<1>(int* d, unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\nwgmma.mma_async.sync.aligned.m64n8k32.s32.s8.s8 "
                 "{%0, %1, %2, %3}, %4, %5, p;\n}" : BX_WG_D4(0) : BX_WG_AB : "memory");
}
template <> __device__ __forceinline__ void bx_wgmma_s8<2>(int* d, unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\nwgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p;\n}" : BX_WG_D4(0), BX_WG_D4(4) : BX_WG_AB : "memory");
}
template <> __device__ __forceinline__ void bx_wgmma_s8<3>(int* d, unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\nwgmma.mma_async.sync.aligned.m64n24k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, %12, %13, p;\n}"
                 : BX_WG_D4(0), BX_WG_D4(4), BX_WG_D4(8) : BX_WG_AB : "memory");
}
template <> __device__ __forceinline__ void bx_wgmma_s8<4>(int* d, unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}"
                 : BX_WG_D4(0), BX_WG_D4(4), BX_WG_D4(8), BX_WG_D4(12) : BX_WG_AB : "memory");
}
#undef BX_WG_AB
#undef BX_WG_D4
template <int N> __device__ __forceinline__ void bx_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// ---- quantize_rowint: one block of RI_QT threads per token (tokens past M write zero codes);
// each thread takes whole 16-element k-halves: four 16-byte loads, three 16-byte stores ----
extern "C" __global__ void __launch_bounds__(RI_QT) quantize_rowint(const float* __restrict__ x,
                                                                    unsigned char* __restrict__ px,
                                                                    int* __restrict__ sx, int M, int K) {
    __shared__ float red[RI_QT / 32];
    int m = blockIdx.x, KS = K >> 5, H = K >> 4;
    const float4* xv = reinterpret_cast<const float4*>(x + (size_t)min(m, M - 1) * K);  // rows are 128-byte multiples
    bx_pdl_wait();
    const float inf = __int_as_float(0x7f800000);
    float amax = 0.0f;  // max |x| (exact in any order); NaN counts as +inf
    if (m < M)
        for (int h = threadIdx.x; h < H; h += RI_QT)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 v = xv[h * 4 + j];
                float e[4] = {fabsf(v.x), fabsf(v.y), fabsf(v.z), fabsf(v.w)};
#pragma unroll
                for (int i = 0; i < 4; ++i) amax = fmaxf(amax, e[i] != e[i] ? inf : e[i]);
            }
#pragma unroll
    for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(BX_FULL, amax, off));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (int i = 1; i < RI_QT / 32; ++i) amax = fmaxf(amax, red[i]);
    bool bad = amax == inf, live = m < M && !bad;
    int s = bad ? RI_NONFINITE : amax > 0.0f ? ilogbf(amax) - RI_XBITS : 0;
    if (m < M && threadIdx.x == 0) sx[m] = s;
    double f = __longlong_as_double((long long)(1023 - (bad ? 0 : s)) << 52);  // 2^-s, exact
    for (int h = threadIdx.x; h < H; h += RI_QT) {
        unsigned int lo[4], mid[4], hi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float4 v = live ? xv[h * 4 + j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float e[4] = {v.x, v.y, v.z, v.w};
            lo[j] = mid[j] = hi[j] = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int c = __double2int_rn((double)e[i] * f);
                lo[j] |= (unsigned int)(c & 127) << (8 * i);
                mid[j] |= (unsigned int)((c >> 7) & 127) << (8 * i);
                hi[j] |= (unsigned int)((c >> 14) & 255) << (8 * i);
            }
        }
        uint4* o = reinterpret_cast<uint4*>(px + (size_t)((m >> 3) * KS + (h >> 1)) * 3 * 256 + (h & 1) * 128 + (m & 7) * 16);
        o[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        o[16] = make_uint4(mid[0], mid[1], mid[2], mid[3]);
        o[32] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
}

// One k-step of matmul_rowint: the six products of the weights' two 7-bit slices (shared
// address wa) by the input codes' three (xb), into the accumulators of 2^0, 2^7, 2^14, 2^21.
template <int NT> __device__ __forceinline__ void bx_ri_kstep(int (&acc)[4][NT * 4], unsigned int wa, unsigned int xb) {
    bx_wgmma_s8<NT>(acc[0], bx_ri_desc(wa), bx_ri_desc(xb));                           // 2^0:  wl xl
    bx_wgmma_s8<NT>(acc[1], bx_ri_desc(wa), bx_ri_desc(xb + RI_XREC));                 // 2^7:  wl xm
    bx_wgmma_s8<NT>(acc[1], bx_ri_desc(wa + RI_WREC), bx_ri_desc(xb));                 //       wh xl
    bx_wgmma_s8<NT>(acc[2], bx_ri_desc(wa), bx_ri_desc(xb + 2 * RI_XREC));             // 2^14: wl xh
    bx_wgmma_s8<NT>(acc[2], bx_ri_desc(wa + RI_WREC), bx_ri_desc(xb + RI_XREC));       //       wh xm
    bx_wgmma_s8<NT>(acc[3], bx_ri_desc(wa + RI_WREC), bx_ri_desc(xb + 2 * RI_XREC));   // 2^21: wh xh
}

// ---- matmul_rowint: a cluster of RI_S blocks (one warpgroup each) computes 64 rows (group
// rg) by one pass of up to RI_NT * 8 tokens; block r adds its share of the k-steps with
// wgmma from a ring of RI_STAGES shared-memory stages that cp.async fills RI_STAGES - 1
// ahead, the blocks' int64 partials meet through distributed shared memory (exact), and
// block r scales every RI_S-th run of 128 outputs once and stores them while the others
// finish reading its partials.
__device__ __forceinline__ void bx_cp16(unsigned int dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

template <int NT>
__device__ __forceinline__ void bx_matmul_rowint_t(const unsigned char* __restrict__ wg, const int* __restrict__ sw,
                                                   const unsigned char* __restrict__ px, const int* __restrict__ sx,
                                                   float* __restrict__ y, int M, int N, int KS, int rank, int row0,
                                                   int tt0, unsigned char* smem) {
    int tid = threadIdx.x, k0 = rank * KS / RI_S, n = (rank + 1) * KS / RI_S - k0, nst = (n + RI_CH - 1) / RI_CH;
    unsigned int sbase = (unsigned int)__cvta_generic_to_shared(smem);
    int acc[4][NT * 4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < NT * 4; ++i) acc[j][i] = 0;
    auto stage = [&](int st) {  // k-steps k0 + st RI_CH .. into slot st % RI_STAGES; one cp.async group
        if (st < nst) {
            int c = min(RI_CH, n - st * RI_CH), kk0 = k0 + st * RI_CH;
            unsigned int dst = sbase + (st % RI_STAGES) * RI_STAGE, dx = dst + RI_CH * 2 * RI_WREC;
            const unsigned char* src = wg + (size_t)kk0 * 2 * RI_WREC;  // the group's records are contiguous
            for (int p = tid; p < c * 2 * RI_WREC / 16; p += 128) bx_cp16(dst + p * 16, src + p * 16);
            for (int p = tid; p < c * 3 * NT * 16; p += 128) {
                int q = p & 15, t = (p >> 4) % NT, r = (p >> 4) / NT;  // r = k-step in stage * 3 + slice
                bx_cp16(dx + r * RI_XREC + t * 256 + q * 16,
                        px + ((size_t)((tt0 + t) * KS + kk0 + r / 3) * 3 + r % 3) * 256 + q * 16);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int st = 0; st < RI_STAGES - 1; ++st) stage(st);
    for (int st = 0; st < nst; ++st) {
        asm volatile("cp.async.wait_group %0;\nfence.proxy.async.shared::cta;" ::"n"(RI_STAGES - 2) : "memory");
        bx_wgmma_wait<0>();
        __syncthreads();  // stage st is in; every warp is done with the slot stage st - 1 used
        stage(st + RI_STAGES - 1);
        unsigned int a = sbase + (st % RI_STAGES) * RI_STAGE, b = a + RI_CH * 2 * RI_WREC;
        int c = min(RI_CH, n - st * RI_CH);
        if (c == RI_CH) {  // a full stage: one fence, no branch between its MMAs
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int kl = 0; kl < RI_CH; ++kl) bx_ri_kstep<NT>(acc, a + kl * 2 * RI_WREC, b + kl * 3 * RI_XREC);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        } else {  // the block's short last stage
            for (int kl = 0; kl < c; ++kl) {
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                bx_ri_kstep<NT>(acc, a + kl * 2 * RI_WREC, b + kl * 3 * RI_XREC);
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            }
        }
    }
    bx_wgmma_wait<0>();
    asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < NT * 4; ++i) asm volatile("" : "+r"(acc[j][i])::"memory");
    __syncthreads();  // the stages are no longer read: they hold this block's partials [RI_NT * 8][64]
    long long* part = reinterpret_cast<long long*>(smem);
    int lane = tid & 31, w = tid >> 5, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            part[(8 * j + 2 * t4 + (i & 1)) * 64 + 16 * w + g + 8 * (i >> 1)] =
                (long long)acc[0][4 * j + i] + (long long)acc[1][4 * j + i] * 128 +
                (long long)acc[2][4 * j + i] * 16384 + (long long)acc[3][4 * j + i] * 2097152;
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    constexpr int PER = (64 * NT * 8 + 128 * RI_S - 1) / (128 * RI_S);  // outputs per thread
    long long I[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {  // output o (token o / 64, row o % 64): every block's partial of it
        int o = tid + 128 * (rank + RI_S * i);
        I[i] = 0;
        if (o >= 64 * NT * 8) continue;
        unsigned int at = sbase + o * 8;
#pragma unroll
        for (int q = 0; q < RI_S; ++q) {
            unsigned int rq;
            long long v;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rq) : "r"(at), "r"(q));
            asm volatile("ld.shared::cluster.s64 %0, [%1];" : "=l"(v) : "r"(rq) : "memory");
            I[i] += v;
        }
    }
    // this block reads no more of the others' shared memory; it stores while they finish
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int o = tid + 128 * (rank + RI_S * i), m = tt0 * 8 + o / 64, nr = row0 + o % 64;
        if (o >= 64 * NT * 8 || m >= M || nr >= N) continue;
        int a = sx[m], bs = sw[nr];  // finite rows: |a + bs| < 400, so 2^(a + bs) is a normal double
        y[(size_t)m * N + nr] = a == RI_NONFINITE || bs == RI_NONFINITE
            ? __int_as_float(0x7fffffff)
            : __double2float_rn((double)I[i] * __longlong_as_double((long long)(1023 + a + bs) << 52));
    }
    // no block leaves while another may still read its shared memory
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Products of the input codes with one to three matrices of one K (Q, K, V; gate, up), one
// launch: matrix i has N_i rows (0: none; the host pads pw_i, sw_i, y_i with matrix 0's) and
// starts at a 64-row group of its own. Grid: x = RI_S * (row groups of all matrices) * passes
// (cluster rank fastest, then pass, then row group: the passes over one group run close
// together and share its weights in L2). Dynamic shared memory: RI_STAGES * RI_STAGE bytes.
extern "C" __global__ void __cluster_dims__(RI_S, 1, 1) __launch_bounds__(128) matmul_rowint(
    const unsigned char* __restrict__ pw0, const unsigned char* __restrict__ pw1,
    const unsigned char* __restrict__ pw2, const int* __restrict__ sw0, const int* __restrict__ sw1,
    const int* __restrict__ sw2, float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int N0,
    int N1, int N2, const unsigned char* __restrict__ px, const int* __restrict__ sx, int M, int K) {
    extern __shared__ __align__(128) unsigned char smem[];
    int passes = (M + RI_NT * 8 - 1) / (RI_NT * 8), rank = blockIdx.x % RI_S, pass = blockIdx.x / RI_S % passes;
    int rg = blockIdx.x / RI_S / passes, KS = K >> 5, tt0 = pass * RI_NT, g0 = (N0 + 63) >> 6, g1 = (N1 + 63) >> 6;
    const unsigned char* pw = pw0;
    const int* sw = sw0;
    float* y = y0;
    int N = N0;
    if (rg >= g0 + g1) pw = pw2, sw = sw2, y = y2, N = N2, rg -= g0 + g1;
    else if (rg >= g0) pw = pw1, sw = sw1, y = y1, N = N1, rg -= g0;
    int nt = min(RI_NT, ((M + 7) >> 3) - tt0);
    const unsigned char* wg = pw + (size_t)rg * KS * 2 * RI_WREC;
    int k0 = rank * KS / RI_S, k1 = (rank + 1) * KS / RI_S;
    for (int o = threadIdx.x * 128; o < min(k1 - k0, RI_CH * (RI_STAGES - 1)) * 2 * RI_WREC; o += 128 * 128)
        bx_prefetch_l2(wg + (size_t)k0 * 2 * RI_WREC + o);  // while the previous kernel finishes
    bx_pdl_wait();
    if (nt == 4) bx_matmul_rowint_t<4>(wg, sw, px, sx, y, M, N, KS, rank, rg * 64, tt0, smem);
    else if (nt == 3) bx_matmul_rowint_t<3>(wg, sw, px, sx, y, M, N, KS, rank, rg * 64, tt0, smem);
    else if (nt == 2) bx_matmul_rowint_t<2>(wg, sw, px, sx, y, M, N, KS, rank, rg * 64, tt0, smem);
    else bx_matmul_rowint_t<1>(wg, sw, px, sx, y, M, N, KS, rank, rg * 64, tt0, smem);
}
