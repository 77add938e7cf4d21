// tests/test_fuzz_regressions.cpp: the fuzz harnesses (tests/fuzz/fuzz_*.cpp) in the normal suite, over every seed
// of tests/fuzz/corpus/ and every input a fuzzer once failed on (tests/fuzz/regressions/): none may crash or throw
// past the harness. Also: each reader's read(path) and in-memory parse() agree, the seeds are the valid files they
// claim to be, and each kept regression input is refused with the error its fix gives. Fuzzing itself is
// scripts/fuzz.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"
#include "tests/file_test_util.hpp"
#include "tests/fuzz/fuzz_targets.hpp"
#include "tools/npy.hpp"

namespace gpt2attn {
namespace {

namespace fs = std::filesystem;
using testutil::ThrowsError;

const fs::path kFuzzDir = GPT2ATTN_FUZZ_DIR;  // tests/fuzz in the source tree (tests/CMakeLists.txt)

struct Target {
  const char* name;
  int (*run)(const uint8_t*, size_t);
};
const Target kTargets[] = {{"safetensors", fuzz::fuzz_safetensors},
                           {"npy", fuzz::fuzz_npy},
                           {"config", fuzz::fuzz_config},
                           {"layer", fuzz::fuzz_layer},
                           {"quantized", fuzz::fuzz_quantized}};

// The regular files of `dir`, sorted (none when it does not exist: a target may have no regressions yet).
std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> files;
  if (!fs::is_directory(dir)) return files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<uint8_t> bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<fs::path> inputs_of(const std::string& target) {
  std::vector<fs::path> all = files_in(kFuzzDir / "corpus" / target);
  for (const auto& p : files_in(kFuzzDir / "regressions" / target)) all.push_back(p);
  return all;
}

class FuzzInputs : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzInputs, CorpusAndRegressionsRunCleanThroughTheHarness) {
  const Target& t = GetParam();
  EXPECT_FALSE(files_in(kFuzzDir / "corpus" / t.name).empty()) << "no seed corpus in " << kFuzzDir / "corpus" / t.name;
  for (const fs::path& p : inputs_of(t.name)) {
    const std::vector<uint8_t> b = bytes_of(p);
    try {
      t.run(b.data(), b.size());
    } catch (const std::exception& e) {
      ADD_FAILURE() << p.string() << ": " << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fuzz, FuzzInputs, ::testing::ValuesIn(kTargets),
                         [](const ::testing::TestParamInfo<Target>& i) { return std::string(i.param.name); });

// What a reader made of one input: its error, or a rendering of everything it read.
template <class F>
std::string outcome(F&& f) {
  try {
    return "ok: " + f();
  } catch (const Error& e) {
    return "error " + std::to_string(static_cast<int>(e.code())) + ": " + e.what();
  }
}

std::string render(const safetensors::File& f) {
  std::string s = f.path + "\n";
  for (const auto& [key, value] : f.metadata) s += "metadata " + key + "=" + value + "\n";
  for (const auto& [name, t] : f.tensors) {
    s += name + " " + t.dtype + " [";
    for (int64_t d : t.shape) s += std::to_string(d) + ",";
    s += "] " + std::to_string(t.begin) + "-" + std::to_string(t.end) + "\n";
  }
  return s + std::string(f.data.begin(), f.data.end());
}

std::string render(const npy::Array& a) {
  std::string s = a.descr + (a.kind == npy::Kind::f32 ? " f32 (" : " u8 (");
  for (int64_t d : a.shape) s += std::to_string(d) + ",";
  s += ")\n";
  s.append(reinterpret_cast<const char*>(a.f32.data()), a.f32.size() * sizeof(float));
  return s + std::string(a.u8.begin(), a.u8.end());
}

// read(path), map(path) (the tensor-parallel loader's) and parse(bytes) are one parser: the same tensors, bytes and
// messages for every seed and every kept crash input.
TEST(FuzzReaders, ReadFromAFileMapAndParseFromMemoryAgree) {
  int n = 0;
  for (const char* target : {"safetensors", "layer", "quantized"}) {
    for (const fs::path& p : inputs_of(target)) {
      const std::vector<uint8_t> b = bytes_of(p);
      const std::string read = outcome([&] { return render(safetensors::read(p.string())); });
      EXPECT_EQ(read, outcome([&] { return render(safetensors::parse(p.string(), b.data(), b.size())); }))
          << p.string();
      EXPECT_EQ(read, outcome([&] { return render(safetensors::map(p.string())); })) << p.string();
      ++n;
    }
  }
  for (const fs::path& p : inputs_of("npy")) {
    const std::vector<uint8_t> b = bytes_of(p);
    EXPECT_EQ(outcome([&] { return render(npy::read(p.string())); }),
              outcome([&] { return render(npy::parse(p.string(), b.data(), b.size())); }))
        << p.string();
    ++n;
  }
  EXPECT_GT(n, 0);
}

// The seeds are valid files (or refused for the one documented reason their name gives), so the fuzzers start from
// inputs that reach deep into each parser; a seed that rotted into a refused file would quietly weaken them.
TEST(FuzzCorpus, SeedsAreWhatTheirNamesSay) {
  for (const fs::path& p : files_in(kFuzzDir / "corpus" / "safetensors"))
    EXPECT_NO_THROW(safetensors::read(p.string())) << p.string();
  for (const fs::path& p : files_in(kFuzzDir / "corpus" / "layer")) {
    bool loaded = false;
    for (const char* prefix : {"", "h.0.attn.", "layer0."}) {
      for (int64_t heads : {1, 2, 4}) {  // a grouped-query layer needs as many heads as its K/V width implies
        try {
          Config c;
          c.num_heads = heads;
          const StoredLayer l = open_safetensors_layer(p.string(), prefix);
          l.weights.validate(apply_loaded_shapes(c, l));
          loaded = true;
        } catch (const Error&) {
        }
      }
    }
    EXPECT_TRUE(loaded) << p.string() << " holds no attention layer under \"\", \"h.0.attn.\" or \"layer0.\"";
  }
  for (const fs::path& p : files_in(kFuzzDir / "corpus" / "quantized")) {
    const std::optional<QuantizedLayerShapes> s = quantized_layer_shapes(p.string());
    if (p.filename().string().rfind("float", 0) == 0) {
      EXPECT_FALSE(s.has_value()) << p.string() << " is a float checkpoint, not a quantized file";
      continue;
    }
    ASSERT_TRUE(s.has_value()) << p.string();
    bool loaded = false;
    for (int64_t heads : {1, 2, 4}) {  // a grouped K/V width needs as many heads as it implies
      try {
        Config c;
        c.num_heads = heads;
        load_quantized(p.string(), apply_loaded_shapes(c, *s)).validate(apply_loaded_shapes(c, *s));
        loaded = true;
      } catch (const Error&) {
      }
    }
    EXPECT_TRUE(loaded) << p.string() << " loads under no head count of 1, 2, 4";
  }
  for (const fs::path& p : files_in(kFuzzDir / "corpus" / "npy")) {
    const std::string name = p.filename().string();
    if (name.find("fortran") != std::string::npos) {
      EXPECT_TRUE(ThrowsError([&] { npy::read(p.string()); }, ErrorCode::bad_file, "fortran_order")) << name;
    } else if (name.find("bigendian") != std::string::npos) {
      EXPECT_TRUE(ThrowsError([&] { npy::read(p.string()); }, ErrorCode::bad_file, "big-endian")) << name;
    } else {
      EXPECT_NO_THROW(npy::read(p.string())) << name;
    }
  }
  for (const fs::path& p : files_in(kFuzzDir / "corpus" / "config"))
    EXPECT_NO_THROW(load_any_config(p.string())) << p.string();
}

// Every kept input, with the refusal its fix gives, read from its file as a user's program would: so the suite checks
// the fix itself (without sanitizers an overflow that was only undefined behaviour shows nothing), and a new file in
// tests/fuzz/regressions/ must be listed here with what it is.
struct Regression {
  const char* file;    // under tests/fuzz/regressions/
  const char* needle;  // a word of the bad_file message its fix gives
};
const Regression kRegressions[] = {
    // An empty tensor whose other dimensions multiply past int64: every byte check passed (0 bytes), then view()
    // computed its row-major strides with a signed overflow (UBSan: safetensors.cpp, File::view).
    {"safetensors/empty_shape_strides_overflow.safetensors", "too large for any tensor, even an empty one"},
    // The same shape in a .npy header: read() returned it, and the CLI's TensorView::contiguous then overflowed
    // computing its strides. The first is the fuzzer's own input (fuzz_npy's stride check), the second minimal.
    {"npy/empty_shape_strides_overflow_fuzzed.npy", "too large for any array, even an empty one"},
    {"npy/empty_shape_strides_overflow.npy", "too large for any array, even an empty one"},
};

void read_as_target(const fs::path& p) {
  const std::string target = p.parent_path().filename().string();
  if (target == "safetensors") {
    safetensors::read(p.string());
  } else if (target == "npy") {
    npy::read(p.string());
  } else if (target == "config") {
    load_any_config(p.string());
  } else if (target == "quantized") {
    Config c;
    c.num_heads = 1;
    if (const std::optional<QuantizedLayerShapes> s = quantized_layer_shapes(p.string())) {
      load_quantized(p.string(), apply_loaded_shapes(c, *s));
    }
  } else {
    open_safetensors_layer(p.string(), "");
  }
}

TEST(FuzzRegressions, EachKeptInputIsRefusedWithItsFixsError) {
  std::vector<std::string> listed;
  for (const Regression& r : kRegressions) {
    const fs::path p = kFuzzDir / "regressions" / r.file;
    listed.push_back(p.string());
    ASSERT_TRUE(fs::is_regular_file(p)) << p.string();
    EXPECT_TRUE(ThrowsError([&] { read_as_target(p); }, ErrorCode::bad_file, r.needle)) << p.string();
  }
  for (const Target& t : kTargets)
    for (const fs::path& p : files_in(kFuzzDir / "regressions" / t.name))
      EXPECT_NE(std::find(listed.begin(), listed.end(), p.string()), listed.end())
          << p.string() << " is not listed in kRegressions with the error its fix gives";
}

}  // namespace
}  // namespace gpt2attn
