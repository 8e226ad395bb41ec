// Work claimed a piece at a time by whichever thread is free, for the kernels of a prompt step and
// the decode attention over many sequences.
//
// at::parallel_for gives each thread one fixed share. On the 2-vCPU VMs this project runs on, the
// two threads of one kernel do not run at one speed: on the AMX Xeon one of them took 1.3-1.5x as
// long over the same share of a prompt step's matmuls (`perf` over the 32-stream burst's recorded
// steps: each thread's samples in the kernels, and the faster one's in the barrier after them), as
// a vCPU whose core (and tile unit) another guest shares would. With pieces claimed from a shared
// counter, the faster thread takes more of them and neither waits for the other's share.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvserve_cpu {

// What a thread of parallel_claims asks for its next piece: claim(begin, end) sets [begin, end) and
// returns true, or returns false when every piece has been taken.
class Claims {
 public:
  Claims(int64_t items, int64_t piece) : items_(items), piece_(std::max<int64_t>(1, piece)) {}

  bool operator()(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(piece_, std::memory_order_relaxed);
    if (begin >= items_) return false;
    end = std::min(items_, begin + piece_);
    return true;
  }

 private:
  const int64_t items_, piece_;
  std::atomic<int64_t> next_{0};
};

// Runs worker(claims) on each of up to at::get_num_threads() threads (one per piece at most); the
// worker takes pieces of [0, items) from `claims` until none are left, keeping whatever state it
// sets up once per thread.
template <typename Worker>
void parallel_claims(int64_t items, int64_t piece, const Worker& worker) {
  Claims claims(items, piece);
  const int64_t pieces = (items + std::max<int64_t>(1, piece) - 1) / std::max<int64_t>(1, piece);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pieces));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(claims); });
}

}  // namespace kvserve_cpu
