// Thin torch binding: checks shapes, dtypes and devices, finds the current
// stream, and calls the raw-pointer launchers in kernels.h. This is the only
// file that sees ATen; the only CUDA/MUSA difference here is where the current
// stream comes from.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

#if KVSERVE_MUSA
#include "torch_musa/csrc/core/MUSAStream.h"
static kvStream_t current_stream(const at::Tensor& t) {
  return c10::musa::getCurrentMUSAStream(t.device().index()).stream();
}
#else
#include <c10/cuda/CUDAStream.h>
static kvStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

namespace {

using kvserve::DType;

DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "kvserve kernels support float32, float16 and bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

void check_launch(const char* err) { TORCH_CHECK(err == nullptr, "kvserve kernel launch failed: ", err); }

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), name, " must be on ", a.device(), ", got ", b.device());
}

// key_cache [num_blocks, num_kv_heads, head_size/x, block_size, x]
// value_cache [num_blocks, num_kv_heads, head_size, block_size]
// Returns (num_kv_heads, head_size, block_size) after validating both.
std::tuple<int64_t, int64_t, int64_t> check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 5, "key_cache must be [num_blocks, num_kv_heads, head_size/x, block_size, x]");
  TORCH_CHECK(value_cache.dim() == 4, "value_cache must be [num_blocks, num_kv_heads, head_size, block_size]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K and V caches must share a dtype");
  check_same_device(key_cache, value_cache, "value_cache");
  const int64_t x = 16 / key_cache.element_size();
  TORCH_CHECK(key_cache.size(4) == x, "key_cache last dim must be x = 16 bytes / element = ", x);
  const int64_t kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  const int64_t head_size = key_cache.size(2) * x;
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == kv_heads &&
                  value_cache.size(2) == head_size && value_cache.size(3) == block_size,
              "value_cache shape ", value_cache.sizes(), " does not match key_cache ", key_cache.sizes());
  return {kv_heads, head_size, block_size};
}

// out, query [num_seqs, num_heads, head_size]; block_tables [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32. partition_size 0 → v1, else v2 (multiple of 128).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     double scale, int64_t max_seq_len, int64_t partition_size) {
  const auto [kv_heads, head_size, block_size] = check_caches(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == head_size, "query must be [num_seqs, num_heads, ", head_size, "]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_size, "query heads must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_heads % kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ", kv_heads);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [num_seqs]");
  for (const at::Tensor* t : {&query, &value_cache, &block_tables, &seq_lens, static_cast<const at::Tensor*>(&out)})
    check_same_device(key_cache, *t, "inputs");
  TORCH_CHECK(partition_size >= 0 && partition_size % kvserve::kAttnTokensPerTile == 0,
              "partition_size must be 0 (v1) or a multiple of ", kvserve::kAttnTokensPerTile);
  const DType dtype = to_dtype(query);
  TORCH_CHECK(kvserve::paged_attention_supported(dtype, static_cast<int>(head_size), static_cast<int>(block_size)),
              "unsupported head_size ", head_size, " / block_size ", block_size);
  if (num_seqs == 0) return;

  const c10::DeviceGuard guard(query.device());
  kvserve::PagedAttentionParams p{};
  at::Tensor exp_sums, max_logits, tmp_out;
  int64_t max_parts = 1;
  if (partition_size > 0) {
    max_parts = std::max<int64_t>(1, (max_seq_len + partition_size - 1) / partition_size);
    const auto f32 = query.options().dtype(at::kFloat);
    exp_sums = at::empty({num_seqs, num_heads, max_parts}, f32);
    max_logits = at::empty({num_seqs, num_heads, max_parts}, f32);
    tmp_out = at::empty({num_seqs, num_heads, max_parts, head_size}, f32);
    p.exp_sums = exp_sums.data_ptr<float>();
    p.max_logits = max_logits.data_ptr<float>();
    p.tmp_out = tmp_out.data_ptr<float>();
  }
  p.dtype = dtype;
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(kv_heads);
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(block_size);
  p.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.q_seq_stride = query.stride(0);
  p.kv_block_stride = key_cache.stride(0);
  p.kv_head_stride = key_cache.stride(1);
  p.scale = static_cast<float>(scale);
  p.partition_size = static_cast<int>(partition_size);
  p.max_num_partitions = static_cast<int>(max_parts);
  check_launch(kvserve::paged_attention_launch(p, current_stream(query)));
}

// key, value [num_tokens, num_kv_heads, head_size] (token stride free); slot_mapping [num_tokens] int64.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  const auto [kv_heads, head_size, block_size] = check_caches(key_cache, value_cache);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kv_heads && t->size(2) == head_size,
                "key/value must be [num_tokens, ", kv_heads, ", ", head_size, "], got ", t->sizes());
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_size, "key/value heads must be contiguous");
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type(), "key/value dtype must match the cache");
    check_same_device(key_cache, *t, "key/value");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [num_tokens]");
  check_same_device(key_cache, slot_mapping, "slot_mapping");
  to_dtype(key);
  if (key.size(0) == 0) return;
  const c10::DeviceGuard guard(key.device());
  check_launch(kvserve::reshape_and_cache_launch(
      key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(),
      static_cast<int>(key.size(0)), static_cast<int>(kv_heads), static_cast<int>(head_size),
      static_cast<int>(block_size), key.stride(0), value.stride(0), static_cast<int>(key.element_size()),
      current_stream(key)));
}

// key_caches, value_caches: one per layer, all alike; block_mapping [num_pairs, 2] int64 (src, dst).
void copy_blocks(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                 const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many key caches as value caches");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2 && block_mapping.scalar_type() == at::kLong,
              "block_mapping must be int64 [num_pairs, 2]");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const at::Tensor& k0 = key_caches[0];
  std::vector<int64_t> ptrs;
  ptrs.reserve(2 * key_caches.size());
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_caches(key_caches[i], value_caches[i]);
    TORCH_CHECK(key_caches[i].sizes() == k0.sizes() && key_caches[i].scalar_type() == k0.scalar_type(),
                "all layers' caches must be alike");
    check_same_device(k0, key_caches[i], "key_caches");
    ptrs.push_back(reinterpret_cast<int64_t>(key_caches[i].data_ptr()));
  }
  for (const at::Tensor& v : value_caches) ptrs.push_back(reinterpret_cast<int64_t>(v.data_ptr()));
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const c10::DeviceGuard guard(k0.device());
  // Pointer table and mapping travel to the device in one small copy each.
  const at::Tensor ptr_cpu = at::from_blob(ptrs.data(), {2 * num_layers}, at::kLong);
  const at::Tensor ptr_dev = ptr_cpu.to(k0.device());
  const at::Tensor mapping = block_mapping.to(k0.device()).contiguous();
  const int64_t bytes_per_block = k0.stride(0) * k0.element_size();
  check_launch(kvserve::copy_blocks_launch(ptr_dev.data_ptr<int64_t>(), ptr_dev.data_ptr<int64_t>() + num_layers,
                                           mapping.data_ptr<int64_t>(), static_cast<int>(num_layers),
                                           static_cast<int>(mapping.size(0)), bytes_per_block, current_stream(k0)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve paged-attention kernels (CUDA / MUSA)";
  m.def("paged_attention", &paged_attention, "decode attention over the paged KV cache (v1: partition_size=0, v2: >0)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("max_seq_len"), py::arg("partition_size"));
  m.def("reshape_and_cache", &reshape_and_cache, "write new K/V into their slots (slot < 0 skipped)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("copy_blocks", &copy_blocks, "copy-on-write block pairs in every layer, one launch",
        py::arg("key_caches"), py::arg("value_caches"), py::arg("block_mapping"));
}
