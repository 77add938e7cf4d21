// engine/dispatch.cpp: the ordered table of kernel sets (engine/dispatch.hpp) and the lookup into it.
#include "engine/dispatch.hpp"

#include <cstdlib>
#include <string>

#include "gpt2attn/error.hpp"

namespace gpt2attn::detail {

const std::vector<KernelSet>& kernel_table() {
  namespace k = kernels;
  static const std::vector<KernelSet> table = {
      {"bf16/avx512_bf16", Isa::avx512_bf16, DType::bf16, DType::bf16,
       "vdpbf16ps: two bf16 products per f32 lane, twice an FMA's where the CPU issues it as fast (README); f32 sums",
       &k::attention_bf16_avx512_bf16(), &k::decode_attention_f32_kvbf16_avx512(), &k::linear_bf16_avx512()},
      {"bf16-kvi8/avx512_bf16", Isa::avx512_bf16, DType::bf16, DType::i8,
       "bf16 compute serving an int8 KV cache: prefill widens as bf16-kvi8/avx512, decode scores on vpdpwssd (VNNI)",
       &k::attention_bf16_kvi8_avx512(), &k::decode_attention_f32_kvi8_avx512_bf16(), &k::linear_bf16_avx512()},
      {"f32-kvi8/avx512_bf16", Isa::avx512_bf16, DType::f32, DType::i8,
       "an int8 KV cache whose decode scores run on vpdpwssd (AVX512-VNNI); the rest as avx512's",
       &k::attention_f32_kvi8_avx512(), &k::decode_attention_f32_kvi8_avx512_bf16(), &k::linear_f32_avx512()},
      {"f32/avx512", Isa::avx512, DType::f32, DType::f32,
       "16 lanes and 32 registers: 4 query vectors x 6 rows in the micro-kernels",
       &k::attention_f32_avx512(), &k::decode_attention_f32_avx512(), &k::linear_f32_avx512()},
      {"f32-kvbf16/avx512", Isa::avx512, DType::f32, DType::bf16,
       "a bf16 KV cache: half the K/V bytes a decode step streams, widened to f32 as they are loaded",
       &k::attention_f32_kvbf16_avx512(), &k::decode_attention_f32_kvbf16_avx512(), &k::linear_f32_avx512()},
      {"f32-kvi8/avx512", Isa::avx512, DType::f32, DType::i8,
       "an int8 KV cache: about a quarter of the f32 K/V bytes, rows widened to f32 and scaled once per key",
       &k::attention_f32_kvi8_avx512(), &k::decode_attention_f32_kvi8_avx512(), &k::linear_f32_avx512()},
      {"bf16/avx512", Isa::avx512, DType::bf16, DType::bf16,
       "bf16 compute without AVX512-BF16: bf16 Q/K/V widened to f32 on load, the f32 arithmetic",
       &k::attention_bf16_avx512(), &k::decode_attention_f32_kvbf16_avx512(), &k::linear_bf16_avx512()},
      {"bf16-kvf32/avx512", Isa::avx512, DType::bf16, DType::f32, "bf16 compute serving an f32 KV cache (widened)",
       &k::attention_bf16_kvf32_avx512(), &k::decode_attention_f32_avx512(), &k::linear_bf16_avx512()},
      {"bf16-kvi8/avx512", Isa::avx512, DType::bf16, DType::i8, "bf16 compute serving an int8 KV cache (widened)",
       &k::attention_bf16_kvi8_avx512(), &k::decode_attention_f32_kvi8_avx512(), &k::linear_bf16_avx512()},
      {"f32/avx2", Isa::avx2, DType::f32, DType::f32,
       "8 lanes and 16 registers (AVX2 + FMA): 2 query vectors x 6 rows",
       &k::attention_f32_avx2(), &k::decode_attention_f32_avx2(), &k::linear_f32_avx2()},
      {"f32-kvbf16/avx2", Isa::avx2, DType::f32, DType::bf16, "a bf16 KV cache on AVX2: the same widening loads",
       &k::attention_f32_kvbf16_avx2(), &k::decode_attention_f32_kvbf16_avx2(), &k::linear_f32_avx2()},
      {"f32-kvi8/avx2", Isa::avx2, DType::f32, DType::i8, "an int8 KV cache on AVX2: the same widening loads",
       &k::attention_f32_kvi8_avx2(), &k::decode_attention_f32_kvi8_avx2(), &k::linear_f32_avx2()},
      {"bf16/avx2", Isa::avx2, DType::bf16, DType::bf16, "bf16 compute on AVX2: widened to f32 on load",
       &k::attention_bf16_avx2(), &k::decode_attention_f32_kvbf16_avx2(), &k::linear_bf16_avx2()},
      {"bf16-kvf32/avx2", Isa::avx2, DType::bf16, DType::f32, "bf16 compute serving an f32 KV cache on AVX2",
       &k::attention_bf16_kvf32_avx2(), &k::decode_attention_f32_avx2(), &k::linear_bf16_avx2()},
      {"bf16-kvi8/avx2", Isa::avx2, DType::bf16, DType::i8, "bf16 compute serving an int8 KV cache on AVX2",
       &k::attention_bf16_kvi8_avx2(), &k::decode_attention_f32_kvi8_avx2(), &k::linear_bf16_avx2()},
      {"f32/scalar", Isa::scalar, DType::f32, DType::f32,
       "the portable twin: the same algorithms on one lane, for any CPU",
       &k::attention_f32_scalar(), &k::decode_attention_f32_scalar(), &k::linear_f32_scalar()},
      {"f32-kvbf16/scalar", Isa::scalar, DType::f32, DType::bf16, "the portable twin of the bf16 KV cache rows",
       &k::attention_f32_kvbf16_scalar(), &k::decode_attention_f32_kvbf16_scalar(), &k::linear_f32_scalar()},
      {"f32-kvi8/scalar", Isa::scalar, DType::f32, DType::i8, "the portable twin of the int8 KV cache rows",
       &k::attention_f32_kvi8_scalar(), &k::decode_attention_f32_kvi8_scalar(), &k::linear_f32_scalar()},
      {"bf16/scalar", Isa::scalar, DType::bf16, DType::bf16,
       "the portable twin of bf16/avx512_bf16: its pair algorithm on a one-lane dot product",
       &k::attention_bf16_scalar(), &k::decode_attention_f32_kvbf16_scalar(), &k::linear_bf16_scalar()},
      {"bf16-kvf32/scalar", Isa::scalar, DType::bf16, DType::f32, "bf16 compute serving an f32 KV cache, portable",
       &k::attention_bf16_kvf32_scalar(), &k::decode_attention_f32_scalar(), &k::linear_bf16_scalar()},
      {"bf16-kvi8/scalar", Isa::scalar, DType::bf16, DType::i8, "bf16 compute serving an int8 KV cache, portable",
       &k::attention_bf16_kvi8_scalar(), &k::decode_attention_f32_kvi8_scalar(), &k::linear_bf16_scalar()},
  };
  return table;
}

Isa resolve_isa(Isa requested) {
  if (requested == Isa::best) {
    const char* env = std::getenv("GPT2ATTN_ISA");
    requested = (env && *env) ? isa_from_string(env) : Isa::best;
  }
  if (requested == Isa::best) return best_supported_isa();
  if (!isa_supported(requested)) {
    invalid(std::string("instruction set ") + to_string(requested) + " is not supported by this CPU (best: " +
            to_string(best_supported_isa()) + ")");
  }
  return requested;
}

const KernelSet& kernels_for(Isa resolved, DType compute, DType kv) {
  // compiled_isas() is best first: a row is at or below `resolved` when its level comes at or after it.
  const std::vector<Isa> order = compiled_isas();
  auto rank = [&](Isa isa) {
    for (size_t i = 0; i < order.size(); ++i) {
      if (order[i] == isa) return i;
    }
    return order.size();
  };
  for (const KernelSet& row : kernel_table()) {
    if (rank(row.isa) >= rank(resolved) && row.compute == compute && row.kv == kv && isa_supported(row.isa)) {
      return row;
    }
  }
  invalid(std::string("no kernels for compute dtype ") + to_string(compute) + " with K/V dtype " + to_string(kv) +
          " at instruction set " + to_string(resolved) + " or below");
}

}  // namespace gpt2attn::detail
