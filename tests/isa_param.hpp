// tests/isa_param.hpp: the one instruction-set parameterisation of the tests: a fixture that skips on a CPU
// lacking the level, and one macro that instantiates a suite over every level the library was compiled for.
// It knows nothing of what a test checks; suites add their own helpers by deriving from IsaTest.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/dispatch.hpp"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "tests/test_util.hpp"  // gpt2attn::PrintTo(Isa): gtest prints the parameter as "avx2", not raw bytes

namespace gpt2attn::test {

// A test run once per instruction set, forced; a level this CPU cannot run is skipped, never passed.
class IsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU lacks " << to_string(GetParam());
  }
  Isa isa() const { return GetParam(); }
};

// The level a layer forced to `forced` runs its `compute` kernels at (MultiHeadAttention::isa()): `forced` itself,
// or the next level down where `forced` has no rows of that type (avx512_bf16 has no f32/f32 row).
inline Isa kernel_level(Isa forced, DType compute) { return detail::kernels_for(forced, compute, compute).isa; }

// Every K/V storage format of the kernel list (kernels/kernel_list.def), in DType's order (f32, bf16, i8, fp8): the
// tests that cover "every K/V format" loop over this, so a format added to the list is tested without a test edit.
inline std::vector<DType> kv_formats() { return kv_cache_dtypes(); }
// The same without f32: the formats that round what they store.
inline std::vector<DType> stored_kv_formats() {
  std::vector<DType> out = kv_formats();
  out.erase(std::remove(out.begin(), out.end(), DType::f32), out.end());
  return out;
}

// Where `isa` stands among the levels this CPU runs: {its index k, their count n}, for the long suites that split
// N cases or operations between the levels (their share k: [k N / n, (k + 1) N / n)).
inline std::pair<int64_t, int64_t> runnable_isa_index(Isa isa) {
  std::vector<Isa> runnable;
  for (Isa i : compiled_isas()) {
    if (isa_supported(i)) runnable.push_back(i);
  }
  const int64_t k = std::find(runnable.begin(), runnable.end(), isa) - runnable.begin();
  return {k, static_cast<int64_t>(runnable.size())};
}

// The test-name suffix: "Isa/FastPathSweep.RandomCasesMatchReference/avx2".
inline std::string isa_name(const ::testing::TestParamInfo<Isa>& info) { return to_string(info.param); }

}  // namespace gpt2attn::test

// Instantiates `Suite` (deriving from test::IsaTest) once per compiled level, best first, scalar last, so a build
// without a level lists no test for it. `Prefix` names the file's tests as a group: --gtest_filter='Prefix*'.
#define GPT2ATTN_INSTANTIATE_ISAS(Prefix, Suite)                                                \
  INSTANTIATE_TEST_SUITE_P(Prefix, Suite, ::testing::ValuesIn(::gpt2attn::compiled_isas()), \
                           ::gpt2attn::test::isa_name)
