// tests/tolerance.hpp: the comparison every test uses, on the one tolerance policy (gpt2attn/tolerance.hpp).
// Failures print index, expected, got, error, allowed and the ISA under test (first few only).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "gpt2attn/tolerance.hpp"

namespace gpt2attn::test {

using Dtype = gpt2attn::DType;  // the policy itself lives in include/gpt2attn/tolerance.hpp

// Compares `got` to `expected` element-wise, within tolerance(max |expected|); NaN where the reference is finite is
// always a failure.
template <class Got, class TolFn>
::testing::AssertionResult all_close_within(const std::vector<Got>& got, const std::vector<double>& expected,
                                            TolFn&& tolerance, const std::string& context) {
  if (got.size() != expected.size()) {
    return ::testing::AssertionFailure() << context << ": size " << got.size() << " != " << expected.size();
  }
  double max_ref = 0;
  for (double e : expected) max_ref = std::fmax(max_ref, std::fabs(e));
  const Tolerance tol = tolerance(max_ref);
  std::ostringstream msg;
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), e = expected[i];
    const double err = std::fabs(g - e), allowed = tol.atol + tol.rtol * std::fabs(e);
    const bool ok = std::isfinite(e) ? (std::isfinite(g) && err <= allowed) : (std::isnan(e) == std::isnan(g));
    if (!ok) {
      if (bad < 5) {
        msg << "\n  [" << i << "] expected " << e << " got " << g << " error " << err << " allowed " << allowed;
      }
      ++bad;
    }
    if (std::isfinite(err)) worst = std::fmax(worst, err);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << context << ": " << bad << " of " << got.size()
                                       << " elements out of tolerance (rtol " << tol.rtol << ", atol " << tol.atol
                                       << ", worst finite error " << worst << ")" << msg.str();
}

// At the policy of compute type `dtype` (tolerance_for).
template <class Got>
::testing::AssertionResult all_close(const std::vector<Got>& got, const std::vector<double>& expected, Dtype dtype,
                                     int64_t reduction_length, const std::string& context) {
  return all_close_within(got, expected, [&](double m) { return tolerance_for(dtype, reduction_length, m); }, context);
}

// A decode over a cache of `kv` (head size head_dim) against naive attention over the K/V the cache really holds
// (kv_kernel_tolerance: the f32 policy, plus int8's query rounding).
template <class Got>
::testing::AssertionResult all_close_over_cache(const std::vector<Got>& got, const std::vector<double>& expected,
                                                Dtype kv, int64_t head_dim, int64_t reduction_length,
                                                const std::string& context) {
  return all_close_within(
      got, expected, [&](double m) { return kv_kernel_tolerance(kv, head_dim, reduction_length, m); }, context);
}

}  // namespace gpt2attn::test
