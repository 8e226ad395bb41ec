// Decode paged attention (one new query token per sequence), v1 and v2.
//
// Work split: one CTA per (kv head, slice of its query heads, sequence,
// partition). All query heads of a GQA group (up to kMaxG) share a CTA, so each
// K/V byte is read from memory once per kv head rather than once per query
// head — decode attention is bandwidth-bound and this is where the bytes go.
//
// Per tile of kTile (=128) tokens, online softmax (running max m, sum l):
//   QK: thread t owns token t of the tile and walks its head_size/x 16-byte key
//       vectors. Neighbouring threads own neighbouring tokens, and in the key
//       layout [.., head_size/x, block_size, x] neighbouring tokens' vectors are
//       adjacent, so every warp load is contiguous.
//   PV: the value layout [.., head_size, block_size] stores one dim's
//       block_size tokens contiguously: R = block_size/x threads cover one such
//       row with 16-byte loads (again adjacent), each thread keeps fp32
//       accumulators for a fixed set of dims, and the R partial sums are merged
//       with warp shuffles at the end.
// v1 walks the whole context in one CTA; v2 splits it into partitions of
// partition_size tokens (more CTAs for few/long sequences) and a reduce kernel
// merges the partials with their (max, sum) weights.
#pragma once

#include <cfloat>
#include <cstdint>

#include "compat.h"
#include "dtype.cuh"
#include "kernels.h"

namespace kvserve {
namespace attn {

constexpr int kThreads = 128;
constexpr int kTile = kAttnTokensPerTile;
constexpr int kMaxG = 8;  // query heads per CTA; bigger GQA groups use several CTAs
constexpr int kWarps = kThreads / KV_WARP_SIZE;
static_assert(kTile == kThreads, "the QK phase gives each thread one token of the tile");

// Largest divisor of n that is <= 8: how many 16-byte key vectors a thread
// loads back to back (memory parallelism) without unbounded register use.
__host__ __device__ constexpr int load_batch(int n) { return n % 8 == 0 ? 8 : n % 7 == 0 ? 7 : n % 6 == 0 ? 6 : n % 5 == 0 ? 5 : n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1; }

// Warp reductions of the first n entries of v. n must be the same on every lane
// (it is CTA-uniform where used), so all lanes shuffle together.
__host__ __device__ constexpr int pow2_at_most(int n) { return n >= 16 ? 16 : n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1; }

template <int N>
KV_DEVICE void warp_max(float (&v)[N], int n = N) {
#pragma unroll
  for (int mask = KV_WARP_SIZE / 2; mask >= 1; mask /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < n) v[i] = fmaxf(v[i], kv_shfl_xor(v[i], mask));
}

template <int N>
KV_DEVICE void warp_sum(float (&v)[N], int n = N) {
#pragma unroll
  for (int mask = KV_WARP_SIZE / 2; mask >= 1; mask /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < n) v[i] += kv_shfl_xor(v[i], mask);
}

// Block-wide reduction of one value; `red` holds kWarps floats. Ends with a
// barrier so `red` can be reused immediately.
template <bool kMax>
KV_DEVICE float block_reduce(float v, float* red) {
  float a[1] = {v};
  if (kMax) warp_max(a); else warp_sum(a);
  const int lane = threadIdx.x % KV_WARP_SIZE, warp = threadIdx.x / KV_WARP_SIZE;
  if (lane == 0) red[warp] = a[0];
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();
  return r;
}

template <typename Dt, int HEAD, int BLOCK>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const PagedAttentionParams p) {
  using S = typename Dt::storage;
  constexpr int X = Dt::kVec;         // elements per 16-byte vector: the layout's x
  constexpr int CHUNKS = HEAD / X;    // 16-byte vectors per key
  constexpr int KB = load_batch(CHUNKS);  // key vectors loaded before use (bounded registers)
  constexpr int R = BLOCK / X;        // threads per value row (one dim, BLOCK tokens)
  constexpr int ROWS = kThreads / R;  // value rows in flight per step
  constexpr int BC = ROWS >= HEAD ? ROWS / HEAD : 1;                  // blocks of a tile in flight
  constexpr int DPT = ROWS >= HEAD ? 1 : (HEAD + ROWS - 1) / ROWS;    // dims owned per thread
  constexpr int BPT = kTile / BLOCK;  // blocks per tile
  constexpr int VB = pow2_at_most((16 / DPT) < (BPT / BC) ? (16 / DPT) : (BPT / BC));  // value blocks per load batch
  static_assert(HEAD % X == 0 && BLOCK % X == 0 && kTile % BLOCK == 0 && X % 4 == 0, "unsupported shape");
  static_assert(CHUNKS % KB == 0 && BPT % BC == 0 && (BPT / BC) % VB == 0 && R <= KV_WARP_SIZE, "unsupported shape");

  __shared__ __align__(16) float q_s[kMaxG][HEAD];   // scaled queries of this CTA's heads
  __shared__ __align__(16) float p_s[kMaxG][kTile];  // softmax numerators of the tile
  __shared__ float red_s[2][kWarps][kMaxG];
  __shared__ float o_s[BC > 1 ? kMaxG : 1][BC > 1 ? HEAD : 1];

  const int tid = threadIdx.x;
  const int lane = tid % KV_WARP_SIZE, warp = tid / KV_WARP_SIZE;
  const int group = p.num_heads / p.num_kv_heads;
  const int slices = (group + kMaxG - 1) / kMaxG;
  const int kv_head = blockIdx.x / slices;
  const int slice = blockIdx.x % slices;
  const int head0 = kv_head * group + slice * kMaxG;
  const int ng = min(kMaxG, group - slice * kMaxG);
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int seq_len = p.seq_lens[seq];
  const bool v2 = p.partition_size > 0;
  const int start = v2 ? part * p.partition_size : 0;
  if (v2 && start >= seq_len) return;  // partition past this sequence's end: nothing to do
  const int end = v2 ? min(seq_len, start + p.partition_size) : seq_len;

  const S* q = static_cast<const S*>(p.query) + seq * p.q_seq_stride + static_cast<int64_t>(head0) * HEAD;
  for (int i = tid; i < kMaxG * HEAD; i += kThreads) {
    const int g = i / HEAD, d = i % HEAD;
    q_s[g][d] = g < ng ? Dt::to_float(q[g * HEAD + d]) * p.scale : 0.f;
  }
  __syncthreads();

  const S* k_base = static_cast<const S*>(p.key_cache) + kv_head * p.kv_head_stride;
  const S* v_base = static_cast<const S*>(p.value_cache) + kv_head * p.kv_head_stride;
  const int32_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  // This thread's role in the PV phase.
  const int sub = tid % R;  // which x-token slice of a value row
  const int row = tid / R;
  const int slot = ROWS >= HEAD ? row / HEAD : 0;  // which of the BC blocks in flight
  const int d0 = ROWS >= HEAD ? row % HEAD : row;
  const bool v_active = ROWS >= HEAD ? row < BC * HEAD : true;

  float m[kMaxG], l[kMaxG], acc[kMaxG][DPT];
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) {
    m[g] = -FLT_MAX;  // finite, so exp(m_old - m_new) is 0 rather than NaN on the first tile
    l[g] = 0.f;
#pragma unroll
    for (int k = 0; k < DPT; ++k) acc[g][k] = 0.f;
  }

  for (int tile = start; tile < end; tile += kTile) {
    // ---- QK: scores of this thread's token for every head of the CTA.
    const int tok = tile + tid;
    float s[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) s[g] = tok < end ? 0.f : -FLT_MAX;
    if (tok < end) {
      const int64_t blk = bt[tok / BLOCK];
      const S* kp = k_base + blk * p.kv_block_stride + (tok % BLOCK) * X;
#pragma unroll
      for (int c0 = 0; c0 < CHUNKS; c0 += KB) {
        uint4 kr[KB];
#pragma unroll
        for (int c = 0; c < KB; ++c) kr[c] = *reinterpret_cast<const uint4*>(kp + (c0 + c) * BLOCK * X);
#pragma unroll
        for (int c = 0; c < KB; ++c) {
          float kf[X];
          Dt::unpack(kr[c], kf);
#pragma unroll
          for (int g = 0; g < kMaxG; ++g) {
            if (g < ng) {
#pragma unroll
              for (int e = 0; e < X; ++e) s[g] = fmaf(q_s[g][(c0 + c) * X + e], kf[e], s[g]);
            }
          }
        }
      }
    }

    // ---- Online softmax over the tile.
    float t[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) t[g] = s[g];
    warp_max(t, ng);
    if (lane == 0)
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) red_s[0][warp][g] = t[g];
    __syncthreads();
    float alpha[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      alpha[g] = 1.f;
      if (g >= ng) continue;  // heads past this CTA's slice: nothing to track
      float tmax = red_s[0][0][g];
      for (int w = 1; w < kWarps; ++w) tmax = fmaxf(tmax, red_s[0][w][g]);
      const float m_new = fmaxf(m[g], tmax);
      alpha[g] = expf(m[g] - m_new);
      m[g] = m_new;
      const float e = tok < end ? expf(s[g] - m_new) : 0.f;
      p_s[g][tid] = e;
      t[g] = e;
    }
    warp_sum(t, ng);
    if (lane == 0)
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) red_s[1][warp][g] = t[g];
    __syncthreads();  // p_s and the sums are visible from here on
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g >= ng) continue;
      float tsum = red_s[1][0][g];
      for (int w = 1; w < kWarps; ++w) tsum += red_s[1][w][g];
      l[g] = l[g] * alpha[g] + tsum;
#pragma unroll
      for (int k = 0; k < DPT; ++k) acc[g][k] *= alpha[g];
    }

    // ---- PV: accumulate p * v for this thread's dims and token slices.
    // (No barrier is needed after this phase: the next tile only rewrites
    // p_s/red_s after its first barrier, which every thread reaches after
    // finishing here.)
    if (v_active) {
      // Blocks are taken VB at a time: first every block id, then every value
      // vector of the batch, then the math — so a thread has VB * DPT 16-byte
      // loads in flight instead of one dependent load per step. Slices past
      // the context load nothing (predicated to zero).
#pragma unroll
      for (int b0 = 0; b0 < BPT / BC; b0 += VB) {
        int64_t blk[VB];
#pragma unroll
        for (int j = 0; j < VB; ++j) {
          const int blk_tok = tile + ((b0 + j) * BC + slot) * BLOCK;
          blk[j] = blk_tok < end ? bt[blk_tok / BLOCK] : -1;
        }
        uint4 vr[VB][DPT];
#pragma unroll
        for (int j = 0; j < VB; ++j)
#pragma unroll
          for (int k = 0; k < DPT; ++k) {
            const int d = d0 + k * ROWS;
            vr[j][k].x = vr[j][k].y = vr[j][k].z = vr[j][k].w = 0u;
            if (blk[j] >= 0 && (DPT == 1 || d < HEAD))
              vr[j][k] = *reinterpret_cast<const uint4*>(v_base + blk[j] * p.kv_block_stride + sub * X + d * BLOCK);
          }
#pragma unroll
        for (int j = 0; j < VB; ++j) {
          const int b = (b0 + j) * BC + slot;
          const int valid = end - (tile + b * BLOCK + sub * X);  // tokens of this slice inside the context
          if (blk[j] < 0) continue;
          // This slice's probabilities: X consecutive, 16-byte aligned floats per head
          // (row offsets are multiples of X), read as float4 — the compiler cannot
          // prove that alignment through the runtime `sub` itself.
          float pr[kMaxG][X];
#pragma unroll
          for (int g = 0; g < kMaxG; ++g) {
            const float4* src = reinterpret_cast<const float4*>(&p_s[g][b * BLOCK + sub * X]);
#pragma unroll
            for (int v = 0; v < X / 4; ++v) {
              float4 f;
              f.x = f.y = f.z = f.w = 0.f;
              if (g < ng) f = src[v];
              pr[g][4 * v + 0] = f.x;
              pr[g][4 * v + 1] = f.y;
              pr[g][4 * v + 2] = f.z;
              pr[g][4 * v + 3] = f.w;
            }
          }
#pragma unroll
          for (int k = 0; k < DPT; ++k) {
            float vf[X];
            Dt::unpack(vr[j][k], vf);
            // Slots past the context may hold stale or never-written data (NaN
            // bits): zero them, since 0 * NaN would poison the sum.
            if (valid < X)
#pragma unroll
              for (int e = 0; e < X; ++e) vf[e] = e < valid ? vf[e] : 0.f;
#pragma unroll
            for (int g = 0; g < kMaxG; ++g) {
              if (g < ng) {
#pragma unroll
                for (int e = 0; e < X; ++e) acc[g][k] = fmaf(pr[g][e], vf[e], acc[g][k]);
              }
            }
          }
        }
      }
    }
  }

  // Merge the R threads of a value row (adjacent lanes of one warp).
#pragma unroll
  for (int mask = R / 2; mask >= 1; mask /= 2)
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
#pragma unroll
      for (int k = 0; k < DPT; ++k) acc[g][k] += kv_shfl_xor(acc[g][k], mask);

  // Merge the BC blocks that were in flight side by side (deterministic order).
  if constexpr (BC > 1) {
    for (int s2 = 0; s2 < BC; ++s2) {
      // Unrolled with constant indices so acc stays in registers.
      if (v_active && sub == 0 && slot == s2)
#pragma unroll
        for (int g = 0; g < kMaxG; ++g)
          if (g < ng) o_s[g][d0] = (s2 == 0 ? 0.f : o_s[g][d0]) + acc[g][0];
      __syncthreads();
    }
    if (v_active && sub == 0 && slot == 0)
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < ng) acc[g][0] = o_s[g][d0];
  }
  if (!(v_active && sub == 0 && slot == 0)) return;

  const int64_t row0 = static_cast<int64_t>(seq) * p.num_heads + head0;
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) {
    if (g >= ng) break;
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // empty context → zeros
#pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int d = d0 + k * ROWS;
      if (DPT > 1 && d >= HEAD) break;
      if (!v2) {
        static_cast<S*>(p.out)[(row0 + g) * HEAD + d] = Dt::from_float(acc[g][k] * inv);
      } else {
        const int64_t idx = (row0 + g) * p.max_num_partitions + part;
        p.tmp_out[idx * HEAD + d] = acc[g][k] * inv;
        if (d == 0) {
          p.exp_sums[idx] = l[g];
          p.max_logits[idx] = m[g];
        }
      }
    }
  }
}

// v2: merge the partitions of one (sequence, head). Partition i contributes
// weight exp_sums[i] * exp(max_logits[i] - global max).
// Dynamic shared memory: max_num_partitions floats.
template <typename Dt>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce_kernel(const PagedAttentionParams p) {
  using S = typename Dt::storage;
  KV_DYNAMIC_SHARED(float, w_s);
  __shared__ float red[kWarps];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int hs = p.head_size;
  const int num_parts = (p.seq_lens[seq] + p.partition_size - 1) / p.partition_size;
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  S* out = static_cast<S*>(p.out) + row * hs;
  const float* tmp = p.tmp_out + row * p.max_num_partitions * hs;
  if (num_parts <= 1) {  // one partition is already normalised; none means empty context
    for (int d = threadIdx.x; d < hs; d += kThreads) out[d] = Dt::from_float(num_parts == 1 ? tmp[d] : 0.f);
    return;
  }
  const float* ml = p.max_logits + row * p.max_num_partitions;
  const float* es = p.exp_sums + row * p.max_num_partitions;
  float mx = -FLT_MAX;
  for (int i = threadIdx.x; i < num_parts; i += kThreads) mx = fmaxf(mx, ml[i]);
  mx = block_reduce<true>(mx, red);
  float sum = 0.f;
  for (int i = threadIdx.x; i < num_parts; i += kThreads) {
    const float w = es[i] * expf(ml[i] - mx);
    w_s[i] = w;
    sum += w;
  }
  sum = block_reduce<false>(sum, red);  // its barriers also publish w_s
  const float inv = 1.f / sum;
  for (int d = threadIdx.x; d < hs; d += kThreads) {
    float a = 0.f;
    for (int i = 0; i < num_parts; ++i) a = fmaf(w_s[i], tmp[static_cast<int64_t>(i) * hs + d], a);
    out[d] = Dt::from_float(a * inv);
  }
}

template <typename Dt, int HEAD, int BLOCK>
const char* launch(const PagedAttentionParams& p, kvStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int slices = (group + kMaxG - 1) / kMaxG;
  const bool v2 = p.partition_size > 0;
  const dim3 grid(p.num_kv_heads * slices, p.num_seqs, v2 ? p.max_num_partitions : 1);
  KV_LAUNCH((paged_attention_kernel<Dt, HEAD, BLOCK>), grid, kThreads, 0, stream, p);
  if (v2) {
    const dim3 rgrid(p.num_heads, p.num_seqs);
    const size_t shm = static_cast<size_t>(p.max_num_partitions) * sizeof(float);
    KV_LAUNCH(paged_attention_reduce_kernel<Dt>, rgrid, kThreads, shm, stream, p);
  }
  const kvError_t err = kvGetLastError();
  return err == kvSuccess ? nullptr : kvGetErrorString(err);
}

template <typename Dt, int HEAD>
const char* launch_head(const PagedAttentionParams& p, kvStream_t stream) {
  switch (p.block_size) {
    case 8: return launch<Dt, HEAD, 8>(p, stream);
    case 16: return launch<Dt, HEAD, 16>(p, stream);
    case 32: return launch<Dt, HEAD, 32>(p, stream);
    default: return "paged_attention: unsupported block_size (8, 16, 32)";
  }
}

template <typename Dt>
const char* launch_typed(const PagedAttentionParams& p, kvStream_t stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return "paged_attention: num_heads % num_kv_heads != 0";
  if (p.partition_size < 0 || p.partition_size % kTile != 0) return "paged_attention: partition_size must be a multiple of 128";
  switch (p.head_size) {
    case 64: return launch_head<Dt, 64>(p, stream);
    case 80: return launch_head<Dt, 80>(p, stream);
    case 96: return launch_head<Dt, 96>(p, stream);
    case 112: return launch_head<Dt, 112>(p, stream);
    case 128: return launch_head<Dt, 128>(p, stream);
    case 256: return launch_head<Dt, 256>(p, stream);
    default: return "paged_attention: unsupported head_size (64, 80, 96, 112, 128, 256)";
  }
}

}  // namespace attn
}  // namespace kvserve
