// tests/fastpath_util.hpp: what the fast-path suites (tests/test_fastpath_*.cpp) share: the fixture that forces a
// layer onto the ISA under test, a config builder and contiguous random inputs. The comparison itself and the
// tolerance live in tests/test_util.hpp and tests/tolerance.hpp.
#pragma once

#include <cstdint>
#include <limits>
#include <random>

#include "engine/dispatch.hpp"
#include "tests/isa_param.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn::test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Every fast-path test is parameterised over the forced instruction set (prefix "Isa"), so ctest lists each ISA
// separately.
class FastPathTest : public IsaTest {
 protected:
  // A layer forced onto this test's ISA; fails the test if the engine chose something else.
  MultiHeadAttention layer(const Config& c, const Weights& w, int threads) const {
    MultiHeadAttention l(c, w, EngineOptions{.threads = threads, .isa = isa()});
    EXPECT_EQ(l.isa(), kernel_level(isa(), DType::f32))
        << "forced " << to_string(isa()) << ", engine chose " << to_string(l.isa());
    return l;
  }
  // The kernel's own tile geometry for this ISA (query tile BQ, key tile BK), so shapes follow any retuning.
  kernels::TileShape tiles() const { return detail::attention_kernel(isa()).tiles; }
};

inline Config make_config(int64_t E, int64_t H, int64_t d_in = 0, int64_t kdim = 0, int64_t vdim = 0,
                          bool causal = false) {
  Config c;
  c.d_model = E;
  c.num_heads = H;
  c.d_in = d_in;
  c.kdim = kdim;
  c.vdim = vdim;
  c.causal = causal;
  return c;
}

// Contiguous random inputs: self-attention when `self`, else key (B, Tk, kdim) and value (B, Tk, vdim).
inline OwnedInputs simple_inputs(const Config& c, int64_t B, int64_t T, int64_t Tk, bool self, uint64_t seed,
                                 float amp = 1.0f) {
  std::mt19937_64 rng(seed);
  OwnedInputs in;
  in.query = make_tensor(random_uniform(B * T * c.query_width(), rng, -amp, amp), {B, T, c.query_width()}, DType::f32);
  if (!self) {
    in.key = make_tensor(random_uniform(B * Tk * c.key_width(), rng, -amp, amp), {B, Tk, c.key_width()}, DType::f32);
    in.value =
        make_tensor(random_uniform(B * Tk * c.value_width(), rng, -amp, amp), {B, Tk, c.value_width()}, DType::f32);
  }
  return in;
}

}  // namespace gpt2attn::test
