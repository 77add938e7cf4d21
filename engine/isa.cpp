// engine/isa.cpp: the instruction-set levels (gpt2attn/isa.hpp) and what this CPU runs. The table of levels and
// their CPU features is generated from CMakeLists.txt, which compiles each level's kernels with exactly those
// features; here each feature is looked up in CPUID, with the OS's consent to save the registers it uses (XCR0).
#include <cpuid.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/isa.hpp"

namespace gpt2attn {
namespace {

struct Level {
  Isa isa;
  std::vector<const char*> features;
};
const std::vector<Level>& levels() {
  static const std::vector<Level> table = {
#include "isa_levels.inc"
  };
  return table;
}

// Where CPUID reports a feature: leaf, sub-leaf, register (0 eax .. 3 edx), bit; and the XCR0 state components
// the OS must save for its registers (ymm: 0x6, zmm and mask registers: 0xe6).
struct Feature {
  const char* name;
  unsigned leaf, subleaf, reg, bit;
  unsigned long long xcr0;
};
constexpr Feature kFeatures[] = {
    {"fma", 1, 0, 2, 12, 0x6},          {"avx2", 7, 0, 1, 5, 0x6},          {"bmi2", 7, 0, 1, 8, 0},
    {"f16c", 1, 0, 2, 29, 0x6},
    {"avx512f", 7, 0, 1, 16, 0xe6},     {"avx512dq", 7, 0, 1, 17, 0xe6},    {"avx512bw", 7, 0, 1, 30, 0xe6},
    {"avx512vl", 7, 0, 1, 31, 0xe6},    {"avx512vnni", 7, 0, 2, 11, 0xe6},  {"avx512bf16", 7, 1, 0, 5, 0xe6},
};

unsigned long long xcr0() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // no OSXSAVE: no xgetbv
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Each feature of kFeatures, asked of the CPU once per process: CPUID traps to the hypervisor in a VM (about 0.27 ms
// a call measured here), and every layer construction asks for every dispatch row.
bool cpu_has(const std::string& name) {
  static const std::vector<bool> present = [] {
    std::vector<bool> p;
    for (const Feature& f : kFeatures) {
      unsigned r[4] = {0, 0, 0, 0};
      p.push_back(__get_cpuid_count(f.leaf, f.subleaf, &r[0], &r[1], &r[2], &r[3]) && (r[f.reg] >> f.bit & 1u) &&
                  (xcr0() & f.xcr0) == f.xcr0);
    }
    return p;
  }();
  for (size_t i = 0; i < std::size(kFeatures); ++i) {
    if (name == kFeatures[i].name) return present[i];
  }
  fail(ErrorCode::internal, "isa: CPU feature '" + name + "' has no CPUID entry in engine/isa.cpp");
}

const Level* find(Isa isa) {
  for (const Level& l : levels()) {
    if (l.isa == isa) return &l;
  }
  return nullptr;
}

}  // namespace

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::best: return "best";
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

Isa isa_from_string(const std::string& s) {
  for (Isa isa : {Isa::best, Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16}) {
    if (s == to_string(isa)) return isa;
  }
  invalid("unknown instruction set '" + s + "' (expected best, scalar, avx2, avx512 or avx512_bf16)");
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (const Level& l : levels()) out.push_back(l.isa);
  return out;
}

std::vector<std::string> isa_features(Isa isa) {
  const Level* l = find(isa);
  return l ? std::vector<std::string>(l->features.begin(), l->features.end()) : std::vector<std::string>{};
}

bool isa_supported(Isa isa) {
  if (isa == Isa::best) return true;
  const Level* l = find(isa);
  return l && std::all_of(l->features.begin(), l->features.end(), [](const char* f) { return cpu_has(f); });
}

Isa best_supported_isa() {
  for (const Level& l : levels()) {  // best first; scalar (no features) always qualifies
    if (isa_supported(l.isa)) return l.isa;
  }
  return Isa::scalar;
}

}  // namespace gpt2attn
