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
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  ADD_FAILURE() << "no compiler check for feature " << f;
  return false;
}

TEST(Isa, LevelsAreBestFirstAndAgreeWithTheCompilersCpuCheck) {
  const std::vector<Isa> levels = compiled_isas();
  ASSERT_EQ(levels, (std::vector<Isa>{Isa::avx512_bf16, Isa::avx512, Isa::avx2, Isa::scalar}));
  EXPECT_TRUE(isa_features(Isa::scalar).empty());
  const std::vector<std::string> avx2 = isa_features(Isa::avx2);
  EXPECT_NE(std::find(avx2.begin(), avx2.end(), "bmi2"), avx2.end()) << "CMake compiles AVX2 kernels with -mbmi2";
  const std::vector<std::string> bf16 = isa_features(Isa::avx512_bf16);
  EXPECT_NE(std::find(bf16.begin(), bf16.end(), "avx512bf16"), bf16.end()) << "the bf16 level needs vdpbf16ps";
  EXPECT_NE(std::find(bf16.begin(), bf16.end(), "avx512vnni"), bf16.end()) << "its int8 K/V row needs vpdpwssd";
  for (Isa isa : levels) {
    bool all = true;
    for (const std::string& f : isa_features(isa)) all = all && compiler_says(f);
    EXPECT_EQ(isa_supported(isa), all) << to_string(isa);
  }
  EXPECT_TRUE(isa_supported(best_supported_isa()));
  EXPECT_EQ(isa_from_string("avx2"), Isa::avx2);
  EXPECT_EQ(isa_from_string("avx512_bf16"), Isa::avx512_bf16);
  EXPECT_THROW(isa_from_string("sse9"), Error);
}

TEST(DTypes, NamesRoundTripAndSizes) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i8, DType::u8, DType::fp8}) {
    EXPECT_EQ(dtype_from_string(to_string(t)), t);
  }
  EXPECT_EQ(size_of(DType::f32), 4u);
  EXPECT_EQ(size_of(DType::bf16), 2u);
  EXPECT_EQ(size_of(DType::i8), 1u);
  EXPECT_EQ(size_of(DType::fp8), 1u);
  EXPECT_EQ(unit_roundoff(DType::bf16), 0x1p-8);  // 8 significant bits
  EXPECT_EQ(unit_roundoff(DType::f32), 0x1p-24);
  try {
    dtype_from_string("e5m2");
    ADD_FAILURE() << "accepted e5m2";
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
    // The layer packs decode's weights in its compute type: the row's projection kernel must read that type.
    EXPECT_EQ(row.few_row_linear->format, WeightFormat::compute) << row.name;
    EXPECT_EQ(row.few_row_linear->compute, row.compute) << row.name;
    const auto& fallback = detail::kernels_for(Isa::scalar, row.compute, row.kv);
    EXPECT_EQ(fallback.isa, Isa::scalar) << "no scalar twin for " << row.name;
  }
  for (Isa isa : order) {
    const bool has_row = std::any_of(table.begin(), table.end(), [&](const auto& row) { return row.isa == isa; });
    EXPECT_EQ(has_row, isa_supported(isa)) << "rows at compiled level " << to_string(isa);
    if (!isa_supported(isa)) continue;
    // A level falls through to the strongest row at or below it: avx512_bf16 has no f32/f32 row, so f32 at
    // avx512_bf16 is the avx512 row, and bf16 at avx512 is the widening one.
    for (DType compute : {DType::f32, DType::bf16}) {
      const Isa got = detail::kernels_for(isa, compute, compute).isa;
      EXPECT_GE(rank(got), rank(isa)) << to_string(compute) << " at " << to_string(isa) << " picked a stronger row";
      const auto first = std::find_if(table.begin(), table.end(), [&](const auto& row) {
        return rank(row.isa) >= rank(isa) && row.compute == compute && row.kv == compute;
      });
      ASSERT_NE(first, table.end());
      EXPECT_EQ(got, first->isa) << to_string(compute) << " at " << to_string(isa) << " skipped a row";
    }
  }
  if (isa_supported(Isa::avx512_bf16)) {
    EXPECT_EQ(detail::kernels_for(Isa::avx512_bf16, DType::bf16, DType::bf16).isa, Isa::avx512_bf16);
    EXPECT_EQ(detail::kernels_for(Isa::avx512_bf16, DType::f32, DType::f32).isa, Isa::avx512);
  }
  EXPECT_THROW(detail::kernels_for(Isa::scalar, DType::f16, DType::i8), Error);
}

// The table is generated from kernels/kernel_list.def: every kernel of a row was instantiated at the row's level for
// the row's types (each records them from its template arguments), the name says the same, no (level, compute, K/V)
// appears twice, and each level's own list holds exactly the table's rows of that level, with its probes.
TEST(KernelTable, EveryRowsKernelsAreOfItsLevelAndTypes) {
  const auto& table = detail::kernel_table();
  for (const auto& row : table) {
    EXPECT_EQ(row.prefill->isa, row.isa) << row.name;
    EXPECT_EQ(row.prefill->compute, row.compute) << row.name;
    EXPECT_EQ(row.prefill->kv, row.kv) << row.name;
    EXPECT_EQ(row.decode->isa, row.isa) << row.name;
    EXPECT_EQ(row.decode->kv, row.kv) << row.name;
    EXPECT_EQ(row.few_row_linear->isa, row.isa) << row.name;
    const std::string kv = row.kv == row.compute ? "" : std::string("-kv") + to_string(row.kv);
    EXPECT_EQ(row.name, to_string(row.compute) + kv + "/" + to_string(row.isa));
    const auto same = std::count_if(table.begin(), table.end(), [&](const auto& other) {
      return other.isa == row.isa && other.compute == row.compute && other.kv == row.kv;
    });
    EXPECT_EQ(same, 1) << row.name << " appears more than once";
  }
  size_t rows = 0;
  for (Isa isa : compiled_isas()) {
    if (!isa_supported(isa)) {
      EXPECT_THROW(detail::isa_kernels(isa), Error) << to_string(isa) << ": this CPU cannot run its code";
      continue;
    }
    const kernels::IsaKernels& level = detail::isa_kernels(isa);
    EXPECT_EQ(level.int_dot->isa, isa);
    EXPECT_EQ(level.vec->isa, isa);
    // Every level compiles the quantized weight formats of the list's second part, each reading its own format.
    EXPECT_EQ(level.quantized_linear[static_cast<size_t>(WeightFormat::compute)], nullptr);
    for (WeightFormat f : {WeightFormat::int8, WeightFormat::int4}) {
      const kernels::LinearKernel* k = level.quantized_linear[static_cast<size_t>(f)];
      ASSERT_NE(k, nullptr) << to_string(isa) << " " << to_string(f);
      EXPECT_EQ(k->isa, isa);
      EXPECT_EQ(k->format, f);
    }
    for (size_t i = 0; i < level.count; ++i) {
      EXPECT_EQ(level.rows[i].isa, isa);
      ASSERT_LT(rows, table.size());
      EXPECT_EQ(level.rows[i].prefill, table[rows].prefill) << table[rows].name << ": the table keeps the list's order";
      ++rows;
    }
  }
  EXPECT_EQ(rows, table.size());
  EXPECT_THROW(detail::isa_kernels(Isa::best), Error);
}

}  // namespace
}  // namespace gpt2attn
