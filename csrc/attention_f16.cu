// Decode paged attention for one dtype (F16). One translation unit per dtype so
// the instantiations (head sizes x block sizes) compile in parallel.
#include "attention_impl.cuh"

namespace kvserve {

const char* paged_attention_launch_f16(const PagedAttentionParams& p, kvStream_t stream) {
  return attn::launch_typed<F16>(p, stream);
}

}  // namespace kvserve
