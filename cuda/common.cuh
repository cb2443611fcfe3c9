// bitexact: shared device helpers for the determinism contract (docs/determinism.md).
// Every float operation is an explicit correctly rounded intrinsic (__fadd_rn,
// __fmul_rn, ...), so no multiply-add can be contracted into an FMA.
#pragma once

#define BX_FULL 0xffffffffu
#define SPLIT_KV 256  // KV positions per page and attention split (node/reference.py SPLIT_KV)
#define BX_WARP 32

// Programmatic dependent launch (CUDA Programming Guide, "Programmatic
// Dependent Launch and Synchronization"; PTX ISA griddepcontrol). The node
// launches every kernel with programmatic stream serialization
// (node/backend_cuda.py PdlKernel), so a kernel's blocks may start while the
// previous kernel of the stream is still running. Every kernel calls
// bx_pdl_wait() before it reads anything an earlier kernel wrote, before it
// writes global memory and before any return: griddepcontrol.wait returns once
// the previous grid has completed and its writes are visible, so each grid's
// completion still implies its predecessors'. Before the wait a kernel may
// only read constant data (weights) or hint them into L2. After it, the
// block lets the next kernel's blocks be scheduled. No value and no order of
// any operation changes: only when blocks start.
__device__ __forceinline__ void bx_pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
}

// L2 prefetch hint of the 128-byte line holding p (PTX prefetch.global.L2).
__device__ __forceinline__ void bx_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// L1 prefetch hint of the 128-byte line holding p (PTX prefetch.global.L1).
__device__ __forceinline__ void bx_prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// fp16 bits -> fp32, exact (PTX cvt.f32.f16 is a widening conversion).
__device__ __forceinline__ float bx_half(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// bf16 bits -> fp32, exact.
__device__ __forceinline__ float bx_bf16(unsigned short h) {
    return __int_as_float(((unsigned int)h) << 16);
}

// Contract warp_sum, last stage: xor-butterfly with offsets 1, 2, 4, 8, 16.
// Twin: node/reference.py warp_sum (pairwise neighbours-first tree).
__device__ __forceinline__ float bx_butterfly(float v) {
#pragma unroll
    for (int off = 1; off < BX_WARP; off <<= 1)
        v = __fadd_rn(v, __shfl_xor_sync(BX_FULL, v, off));
    return v;
}

// The lowest log2(lanes) levels of that butterfly (offsets 1 .. lanes/2):
// aligned groups of `lanes` lanes each reduce to their subtree of the contract
// tree (a tensor-parallel shard, docs/determinism.md section 12). lanes is a
// power of two <= 32, uniform per warp; lanes = 32 is bx_butterfly.
// Twin: node/reference.py subtree_sum.
__device__ __forceinline__ float bx_butterfly_lanes(float v, int lanes) {
#pragma unroll
    for (int off = 1; off < BX_WARP; off <<= 1)
        if (off < lanes) v = __fadd_rn(v, __shfl_xor_sync(BX_FULL, v, off));
    return v;
}

// The same tree computed by one thread over N lane values p[0..N-1]
// (((p0+p1)+(p2+p3))+...), identical to bx_butterfly's result for N = 32
// and to its top log2(N) levels over N subtrees.
template <int N>
__device__ __forceinline__ float bx_tree(float* p) {
#pragma unroll
    for (int w = 1; w < N; w <<= 1)
#pragma unroll
        for (int i = 0; i < N; i += 2 * w)
            p[i] = __fadd_rn(p[i], p[i + w]);
    return p[0];
}

// Contract exp32 (node/fmath.py exp32). Constants are the fp32 bit patterns.
__device__ __forceinline__ float bx_exp32(float x) {
    if (x != x) return x;
    if (x > __int_as_float(0x42b17218)) return __int_as_float(0x7f800000);
    if (x < __int_as_float(0xc2d00000)) return 0.0f;
    float n = rintf(__fmul_rn(x, __int_as_float(0x3fb8aa3b)));
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, __int_as_float(0x3f318000))),
                        __fmul_rn(n, __int_as_float(0xb95e8083)));
    float p = __int_as_float(0x39500d01);
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3ab60b61));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3c088889));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3d2aaaab));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3e2aaaab));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    int ni = (int)n;
    int n1 = ni >> 1;
    int n2 = ni - n1;
    return __fmul_rn(__fmul_rn(p, __int_as_float((n1 + 127) << 23)), __int_as_float((n2 + 127) << 23));
}

// Contract q8 quantization of one 32-element block whose values the warp's
// lanes hold, element `lane` in lane `lane` (node/reference.py quantize_q8):
// writes this lane's code *q and, from lane 0, the block's scale *d and the
// exact sum of its codes *a. Every lane of the warp must call it. A block holding
// a NaN or an infinity gets d = NaN (bits 0x7fc00000, as numpy's) and codes 0.
__device__ __forceinline__ void bx_quantize_block(float v, int lane, signed char* q, float* d, int* a) {
    const float inf = __int_as_float(0x7f800000);
    float amax = fabsf(v);
    if (amax != amax) amax = inf;  // fmaxf would drop a NaN: it counts as +inf
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(BX_FULL, amax, off));
    float dd = amax == inf ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, 127.0f);
    int qi = 0;
    if (dd > 0.0f) {
        float t = rintf(__fdiv_rn(v, dd));
        qi = (int)fminf(fmaxf(t, -127.0f), 127.0f);
    }
    *q = (signed char)qi;
    int s = qi;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) s += __shfl_xor_sync(BX_FULL, s, off);  // exact integer sum
    if (lane == 0) {
        *d = dd;
        *a = s;
    }
}

// Position of element k of a K-element row in the lane-major layout with
// chunks of V elements (node/reference.py lane_major); V == 0: row-major.
__device__ __forceinline__ int bx_lane_pos(int k, int K, int V) {
    if (V == 0) return k;
    int g = K >> 5, l = k / g, r = k - l * g;
    return ((r / V) * 32 + l) * V + r % V;
}

// Weight type ids shared with node/backend_cuda.py (QTYPE_IDS).
#define BX_F32 0
#define BX_F16 1
#define BX_BF16 2
#define BX_Q8_0 3
#define BX_Q4_0 4
#define BX_Q4_1 5
#define BX_Q4_K 6
#define BX_Q6_K 7

__device__ __forceinline__ unsigned int bx_u16(const unsigned char* p) {
    return *(const unsigned short*)p;  // every use is 2-byte aligned
}

// Four bytes at a 2-byte-aligned address, little endian.
__device__ __forceinline__ unsigned int bx_u32_a2(const unsigned char* p) {
    const unsigned short* s = (const unsigned short*)p;
    return (unsigned int)s[0] | ((unsigned int)s[1] << 16);
}

// Q4_K 6-bit scale and min of sub-block j (ggml get_scale_min_k4).
__device__ __forceinline__ void bx_q4k_scale_min(const unsigned char* sc, int j, int* s, int* m) {
    if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// Q6_K: the 6-bit value (0..63) of element l (0..31) of 32-element block sb (0..7).
__device__ __forceinline__ int bx_q6k_value(const unsigned char* blk, int sb, int l) {
    const unsigned char* ql = blk;
    const unsigned char* qh = blk + 128;
    int h = sb >> 2, k = sb & 3;
    int lo = ql[64 * h + 32 * (k & 1) + l];
    lo = (k >> 1) ? (lo >> 4) : (lo & 0xF);
    int hi = (qh[32 * h + l] >> (2 * k)) & 3;
    return lo | (hi << 4);
}
