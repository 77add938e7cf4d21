// tests/test_dispatch.cpp: the instruction-set table (generated from CMakeLists.txt), the run-time CPU check, the
// dtype vocabulary and the kernel table's lookup: best first, scalar last, unsupported combinations refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "engine/dispatch.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/tolerance.hpp"
#include "tests/test_util.hpp"  // gpt2attn::PrintTo(Isa): every TU that prints an Isa must see the same printer

namespace gpt2attn {
namespace {

// Our CPUID lookup against the compiler's, feature by feature (__builtin_cpu_supports needs literals).
bool compiler_says(const std::string& f) {
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "bmi2") return __builtin_cpu_supports("bmi2");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  ADD_FAILURE() << "no compiler check for feature " << f;
  return false;
}

TEST(Isa, LevelsAreBestFirstAndAgreeWithTheCompilersCpuCheck) {
  const std::vector<Isa> levels = compiled_isas();
  ASSERT_EQ(levels, (std::vector<Isa>{Isa::avx512, Isa::avx2, Isa::scalar}));
  EXPECT_TRUE(isa_features(Isa::scalar).empty());
  const std::vector<std::string> avx2 = isa_features(Isa::avx2);
  EXPECT_NE(std::find(avx2.begin(), avx2.end(), "bmi2"), avx2.end()) << "CMake compiles AVX2 kernels with -mbmi2";
  for (Isa isa : levels) {
    bool all = true;
    for (const std::string& f : isa_features(isa)) all = all && compiler_says(f);
    EXPECT_EQ(isa_supported(isa), all) << to_string(isa);
  }
  EXPECT_TRUE(isa_supported(best_supported_isa()));
  EXPECT_EQ(isa_from_string("avx2"), Isa::avx2);
  EXPECT_THROW(isa_from_string("sse9"), Error);
}

TEST(DTypes, NamesRoundTripAndSizes) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i8, DType::u8}) {
    EXPECT_EQ(dtype_from_string(to_string(t)), t);
  }
  EXPECT_EQ(size_of(DType::f32), 4u);
  EXPECT_EQ(size_of(DType::bf16), 2u);
  EXPECT_EQ(size_of(DType::i8), 1u);
  EXPECT_EQ(unit_roundoff(DType::bf16), 0x1p-8);  // 8 significant bits
  EXPECT_EQ(unit_roundoff(DType::f32), 0x1p-24);
  try {
    dtype_from_string("fp8");
    ADD_FAILURE() << "accepted fp8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
}

TEST(KernelTable, OrderedBestFirstWithAScalarRowForEveryDtypePair) {
  const auto& table = detail::kernel_table();
  ASSERT_FALSE(table.empty());
  const std::vector<Isa> order = compiled_isas();
  auto rank = [&](Isa isa) { return std::find(order.begin(), order.end(), isa) - order.begin(); };
  for (size_t i = 1; i < table.size(); ++i) {
    EXPECT_LE(rank(table[i - 1].isa), rank(table[i].isa)) << table[i].name << " sits above a stronger row";
  }
  for (const auto& row : table) {
    EXPECT_TRUE(row.prefill && row.decode && row.few_row_linear) << row.name;
    EXPECT_GT(std::string(row.why).size(), 10u) << row.name << " says why it exists";
    const auto& fallback = detail::kernels_for(Isa::scalar, row.compute, row.kv);
    EXPECT_EQ(fallback.isa, Isa::scalar) << "no scalar twin for " << row.name;
  }
  for (Isa isa : order) {
    if (!isa_supported(isa)) continue;
    EXPECT_EQ(detail::kernels_for(isa, DType::f32, DType::f32).isa, isa) << to_string(isa);
  }
  EXPECT_THROW(detail::kernels_for(Isa::scalar, DType::f16, DType::i8), Error);
}

}  // namespace
}  // namespace gpt2attn
