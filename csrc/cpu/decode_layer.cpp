// One decoder layer of a decode step in one call: the same kernels, in the same order, with the
// same arguments as executor/model.py's DecoderLayer runs them from Python.
//
// At one token a step a layer's kernels take ~0.6 ms on two cores, and the Python around them
// (module calls, views, the attention backend's dispatch: ~12 ops a layer) took another ~0.3 ms —
// a third of a single-stream step on an AVX2 EPYC. Called from C++ the same ops cost a dispatcher
// lookup each. Nothing is computed differently: a step gives the same bits either way (tested).
//
//   x: [tokens, hidden]; residual: [tokens, hidden] or None (the first layer)
//   weights: input_norm [hidden], qkv, o, post_norm [hidden], gate_up, down (the projections in
//            pack_skinny_weight's, pack_skinny_int8's or pack_skinny_int4's layout, all four in one);
//   biases: qkv, o, gate_up, down (each None or [out])
//   key_cache / value_cache, block_tables, seq_lens, slot_mapping: as paged_decode_attention and
//            write_kv take them, or their _int8 forms for int8 caches (records); cos_sin: [tokens, 2, head_dim]
//   sizes: num_heads, num_kv_heads, head_dim, intermediate
//   returns (the layer's output [tokens, hidden], the residual stream before it)
//
// The projections take skinny_linear (bf16 x) or skinny_linear_f32 (float32 x) for bf16 weights,
// skinny_linear_int8 / _int4 for quantized ones (either x). Registered as
// torch.ops.kvserve_cpu.decode_layer.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using DecodeAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double);

// The registered kernels, looked up once (every unit of the library registers as it loads).
struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&)> rotary_embedding_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  // The float caches' kernels, then the int8 cache's (--kv-cache-dtype int8), which take the same arguments.
  c10::TypedOperatorHandle<WriteKv> write_kv;
  c10::TypedOperatorHandle<DecodeAttention> paged_decode_attention;
  c10::TypedOperatorHandle<WriteKv> write_kv_int8;
  c10::TypedOperatorHandle<DecodeAttention> paged_decode_attention_int8;
  c10::TypedOperatorHandle<Linear> skinny_linear;
  c10::TypedOperatorHandle<Linear> skinny_linear_f32;
  c10::TypedOperatorHandle<Linear> skinny_linear_int8;
  c10::TypedOperatorHandle<Linear> skinny_linear_int4;

  static const Kernels& get() {
    static const Kernels kernels = [] {
      auto& d = c10::Dispatcher::singleton();
      auto op = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Kernels{
          op("kvserve_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
          op("kvserve_cpu::add_rms_norm")
              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double)>(),
          op("kvserve_cpu::rotary_embedding_").typed<void(at::Tensor&, const at::Tensor&)>(),
          op("kvserve_cpu::silu_and_mul").typed<at::Tensor(const at::Tensor&)>(),
          op("kvserve_cpu::write_kv").typed<WriteKv>(),
          op("kvserve_cpu::paged_decode_attention").typed<DecodeAttention>(),
          op("kvserve_cpu::write_kv_int8").typed<WriteKv>(),
          op("kvserve_cpu::paged_decode_attention_int8").typed<DecodeAttention>(),
          op("kvserve_cpu::skinny_linear").typed<Linear>(),
          op("kvserve_cpu::skinny_linear_f32").typed<Linear>(),
          op("kvserve_cpu::skinny_linear_int8").typed<Linear>(),
          op("kvserve_cpu::skinny_linear_int4").typed<Linear>(),
      };
    }();
    return kernels;
  }
};

// The kernel of a packed projection: bytes in two dimensions are pack_skinny_int8's layout, in three
// pack_skinny_int4's; bf16 is pack_skinny_weight's, read by the kernel of x's dtype.
const c10::TypedOperatorHandle<Linear>& projection_kernel(const Kernels& k, const at::Tensor& packed,
                                                          c10::ScalarType x_type) {
  if (packed.scalar_type() == at::kByte) return packed.dim() == 2 ? k.skinny_linear_int8 : k.skinny_linear_int4;
  return x_type == at::kFloat ? k.skinny_linear_f32 : k.skinny_linear;
}

enum Weight { kInputNorm, kQkv, kO, kPostNorm, kGateUp, kDown, kWeights };
enum Bias { kQkvBias, kOBias, kGateUpBias, kDownBias, kBiases };

std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                at::TensorList weights,
                                                const c10::List<c10::optional<at::Tensor>>& biases,
                                                at::Tensor& key_cache, at::Tensor& value_cache,
                                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                const at::Tensor& slot_mapping, const at::Tensor& cos_sin,
                                                at::IntArrayRef sizes, double eps, double scale) {
  TORCH_CHECK(weights.size() == kWeights && biases.size() == kBiases && sizes.size() == 4,
              "decode_layer: 6 weights, 4 biases and 4 sizes");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decode_layer: x must be [tokens, hidden] float32 or bfloat16");
  const Kernels& k = Kernels::get();
  const auto& linear = projection_kernel(k, weights[kQkv], x.scalar_type());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t num_heads = sizes[0], num_kv_heads = sizes[1], head_dim = sizes[2], intermediate = sizes[3];
  const int64_t heads = num_heads + 2 * num_kv_heads;

  at::Tensor h, stream;
  if (residual.has_value()) {
    std::tie(h, stream) = k.add_rms_norm.call(x, *residual, weights[kInputNorm], eps);
  } else {
    h = k.rms_norm.call(x, weights[kInputNorm], eps);
    stream = x;
  }
  // qkv: [tokens, q heads + k heads + v heads, head_dim]; RoPE on q and k together, in place
  at::Tensor qkv = linear.call(h, weights[kQkv], biases.get(kQkvBias), heads * head_dim).view({tokens, heads, head_dim});
  at::Tensor qk = qkv.narrow(1, 0, num_heads + num_kv_heads);
  k.rotary_embedding_.call(qk, cos_sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), key = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor value = qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  (int8_cache ? k.write_kv_int8 : k.write_kv).call(key, value, key_cache, value_cache, slot_mapping);
  const at::Tensor attended = (int8_cache ? k.paged_decode_attention_int8 : k.paged_decode_attention)
                                  .call(q, key_cache, value_cache, block_tables, seq_lens, scale);  // [tokens, heads, d]
  const at::Tensor o = linear.call(attended.reshape({tokens, num_heads * head_dim}), weights[kO], biases.get(kOBias),
                                   hidden);
  std::tie(h, stream) = k.add_rms_norm.call(o, stream, weights[kPostNorm], eps);
  const at::Tensor gate_up = linear.call(h, weights[kGateUp], biases.get(kGateUpBias), 2 * intermediate);
  const at::Tensor out = linear.call(k.silu_and_mul.call(gate_up), weights[kDown], biases.get(kDownBias), hidden);
  return {out, stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("decode_layer(Tensor x, Tensor? residual, Tensor[] weights, Tensor?[] biases, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, Tensor cos_sin, "
        "int[] sizes, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
