// tests/test_safetensors.cpp: the safetensors reader/writer and load_safetensors_layer: both namings (with the
// Conv1D transpose checked element by element), f16/bf16 widening, and one test per corruption class.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <filesystem>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/attention.hpp"
#include "gpt2attn/weights.hpp"
#include "kernels/bf16.hpp"
#include "support/file_io.hpp"
#include "tests/file_test_util.hpp"

namespace gpt2attn {
namespace {

using nlohmann::json;
using testutil::le_bytes;
using testutil::ThrowsError;
using testutil::write_bytes;

class Safetensors : public testutil::TempDirTest {
 protected:
  // Writes `bytes` to a fresh file and returns its path.
  std::string file(const std::string& bytes) {
    const std::string p = path(std::to_string(n_++) + ".safetensors");  // not "f" + ...: GCC 12's false -Wrestrict
    write_bytes(p, bytes);
    return p;
  }
  int n_ = 0;
};

struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// 8-byte little-endian header length, the header text, then the data section.
std::string st_raw(const std::string& header, const std::string& data) {
  return le_bytes(std::vector<uint64_t>{header.size()}) + header + data;
}

// A well-formed file holding `entries` back to back, with optional __metadata__.
std::string st_file(const std::vector<Entry>& entries, const json& metadata = nullptr) {
  json h = json::object();
  std::string data;
  for (const Entry& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
    data += e.bytes;
  }
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  return st_raw(h.dump(), data);
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Distinct values base, base + 1, ... (exact in f32, f16 and bf16 while below 256).
std::vector<float> ramp(int64_t n, float base) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i);
  return v;
}

Entry f32(const std::string& name, const std::vector<int64_t>& shape, float base = 0.0f) {
  return {name, "F32", shape, le_bytes(ramp(numel(shape), base))};
}

// bf16 is the high half of an f32; every value used here is exact in bf16, so truncation is exact.
Entry bf16(const std::string& name, const std::vector<int64_t>& shape, float base = 0.0f) {
  std::vector<uint16_t> h;
  for (float v : ramp(numel(shape), base)) h.push_back(static_cast<uint16_t>(std::bit_cast<uint32_t>(v) >> 16));
  return {name, "BF16", shape, le_bytes(h)};
}

// f32 -> f16 for the small integers ramp() makes (|v| < 2048 and integral: exact, normal or zero).
uint16_t to_f16(float v) {
  if (v == 0.0f) return 0;
  const uint32_t b = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (b >> 16) & 0x8000u, exp = ((b >> 23) & 0xFFu) - 112u, man = (b >> 13) & 0x3FFu;
  return static_cast<uint16_t>(sign | (exp << 10) | man);
}

Entry f16(const std::string& name, const std::vector<int64_t>& shape, float base = 0.0f) {
  std::vector<uint16_t> h;
  for (float v : ramp(numel(shape), base)) h.push_back(to_f16(v));
  return {name, "F16", shape, le_bytes(h)};
}

// ---- the reader and writer ----

TEST_F(Safetensors, WriteThenReadRoundTrips) {
  const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>> tensors = {
      {"scalar", {{}, {3.25f}}},
      {"rank4", {{2, 3, 4, 5}, ramp(120, -60.5f)}},
      {"empty", {{0, 7}, {}}},
      {"vec", {{3}, {1.0f / 3.0f, -0.0f, 1e-40f}}},
  };
  const std::string p = path("w.safetensors");
  safetensors::write_f32(p, tensors);
  EXPECT_EQ(listing(), std::vector<std::string>{"w.safetensors"});

  const std::string bytes = testutil::read_bytes(p);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_len + 4 * (1 + 120 + 0 + 3));

  const safetensors::File f = safetensors::read(p);
  EXPECT_EQ(f.path, p);
  EXPECT_EQ(f.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.has(name)) << name;
    EXPECT_EQ(f.tensors.at(name).dtype, "F32");
    EXPECT_EQ(f.tensors.at(name).shape, t.first) << name;
    const std::vector<float> got = f.to_f32(name);
    ASSERT_EQ(got.size(), t.second.size()) << name;
    EXPECT_TRUE(got.empty() || std::memcmp(got.data(), t.second.data(), got.size() * 4) == 0) << name;
  }
}

TEST_F(Safetensors, WriteRejectsCallerMistakesAndFailsCleanly) {
  using Tensors = std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>>;
  const std::string p = path("w.safetensors");
  EXPECT_TRUE(ThrowsError([&] { safetensors::write_f32(p, Tensors{{"a", {{2, 2}, {1, 2, 3}}}}); },
                          ErrorCode::invalid_argument, "3 values"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write_f32(p, Tensors{{"a", {{1}, {1}}}, {"a", {{1}, {2}}}}); },
                          ErrorCode::invalid_argument, "duplicate"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write_f32(p, Tensors{{"a", {{-1}, {}}}}); },
                          ErrorCode::invalid_argument, "negative"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write_f32(p, Tensors{{"__metadata__", {{1}, {1}}}}); },
                          ErrorCode::invalid_argument, "reserved"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write_f32(path("no_dir/w.safetensors"), Tensors{{"a", {{1}, {1}}}}); },
                          ErrorCode::bad_file, "no_dir/w.safetensors"));
  EXPECT_TRUE(listing().empty());
}

TEST_F(Safetensors, ReadsF16AndBf16Tensors) {
  // f16 bits: 1, -2, smallest subnormal, largest finite, inf, nan; bf16 bits: 1, -3, inf, smallest subnormal.
  const std::vector<uint16_t> h = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0x7E00};
  const std::vector<uint16_t> b = {0x3F80, 0xC040, 0x7F80, 0x0001};
  const std::string p = file(st_file({{"h", "F16", {2, 3}, le_bytes(h)}, {"b", "BF16", {4}, le_bytes(b)}}));
  const safetensors::File f = safetensors::read(p);
  const std::vector<float> hf = f.to_f32("h"), bf = f.to_f32("b");
  ASSERT_EQ(hf.size(), 6u);
  EXPECT_EQ(hf[0], 1.0f);
  EXPECT_EQ(hf[1], -2.0f);
  EXPECT_EQ(hf[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(hf[3], 65504.0f);
  EXPECT_EQ(hf[4], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(hf[5]));
  ASSERT_EQ(bf.size(), 4u);
  EXPECT_EQ(bf[0], 1.0f);
  EXPECT_EQ(bf[1], -3.0f);
  EXPECT_EQ(bf[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(std::bit_cast<uint32_t>(bf[3]), 0x00010000u);
}

#ifdef __FLT16_MAX__
// Every one of the 65536 f16 patterns against the compiler's own conversion.
TEST(HalfConversion, MatchesCompilerForEveryF16Pattern) {
  int failures = 0;
  for (uint32_t bits = 0; bits <= 0xFFFF && failures < 5; ++bits) {
    const auto u = static_cast<uint16_t>(bits);
    const float want = static_cast<float>(std::bit_cast<_Float16>(u));
    const float got = io::f16_to_f32(u);
    const bool same = std::isnan(want) ? std::isnan(got) : std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want);
    if (!same) {
      ++failures;
      ADD_FAILURE() << "f16 0x" << std::hex << bits << ": expected " << want << ", got " << got;
    }
  }
}
#endif

TEST_F(Safetensors, ToF32RefusesOtherDtypesAndUnknownNames) {
  const std::string p = file(st_file({{"ids", "I32", {2}, le_bytes(std::vector<int32_t>{1, 2})},
                                      {"d", "F64", {1}, le_bytes(std::vector<double>{1.0})}}));
  const safetensors::File f = safetensors::read(p);
  EXPECT_TRUE(ThrowsError([&] { f.to_f32("ids"); }, ErrorCode::bad_file, "tensor 'ids' has dtype I32"));
  EXPECT_TRUE(ThrowsError([&] { f.to_f32("d"); }, ErrorCode::bad_file, "F64"));
  EXPECT_TRUE(ThrowsError([&] { f.to_f32("nope"); }, ErrorCode::invalid_argument, "'nope'"));
}

TEST_F(Safetensors, SkipsMetadataAndAcceptsEveryKnownDtype) {
  std::vector<Entry> entries;
  const std::pair<const char*, int> dtypes[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  for (const auto& [dtype, size] : dtypes) entries.push_back({dtype, dtype, {3}, std::string(3 * size, '\0')});
  const safetensors::File f = safetensors::read(file(st_file(entries, {{"format", "pt"}, {"note", "x"}})));
  EXPECT_EQ(f.tensors.size(), 10u);
  EXPECT_FALSE(f.has("__metadata__"));
  EXPECT_EQ(f.tensors.at("BOOL").dtype, "BOOL");
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x"}}));
}

// write(): tensors of any dtype from their bytes, in the order given, with metadata; read() gives back each byte.
TEST_F(Safetensors, WriteAnyDtypeWithMetadataRoundTrips) {
  const std::vector<int8_t> codes = {-128, -1, 0, 1, 127, 5};
  const std::vector<uint8_t> bytes = {0x00, 0xff, 0x80};
  const std::vector<float> values = {1.5f, -0.0f};
  const std::string p = path("w.safetensors");
  const std::map<std::string, std::string> metadata = {{"gpt2attn.weights", "int8"}, {"k", ""}};
  safetensors::write(p,
                     {{"z_codes", "I8", {2, 3}, codes.data(), codes.size()},
                      {"a_bytes", "U8", {3}, bytes.data(), bytes.size()},
                      {"empty", "F32", {0, 4}, nullptr, 0},
                      {"f", "F32", {2}, values.data(), 8}},
                     metadata);
  const safetensors::File f = safetensors::read(p);
  EXPECT_EQ(f.metadata, metadata);
  ASSERT_EQ(f.tensors.size(), 4u);
  const safetensors::Tensor& z = f.tensors.at("z_codes");
  EXPECT_EQ(z.dtype, "I8");
  EXPECT_EQ(z.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(z.begin, 0u);  // the order given, not the names' order
  EXPECT_EQ(std::memcmp(f.data.data() + z.begin, codes.data(), codes.size()), 0);
  const safetensors::Tensor& a = f.tensors.at("a_bytes");
  EXPECT_EQ(a.dtype, "U8");
  EXPECT_EQ(std::memcmp(f.data.data() + a.begin, bytes.data(), bytes.size()), 0);
  EXPECT_EQ(f.to_f32("f"), values);
  EXPECT_TRUE(ThrowsError([&] { safetensors::write(p, {{"x", "Q4", {1}, bytes.data(), 1}}); },
                          ErrorCode::invalid_argument, "unknown dtype 'Q4'"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write(p, {{"x", "F32", {2}, values.data(), 4}}); },
                          ErrorCode::invalid_argument, "4 bytes were given"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::write(p, {{"x", "U8", {2}, nullptr, 2}}); },
                          ErrorCode::invalid_argument, "null"));
  EXPECT_EQ(listing(), std::vector<std::string>{"w.safetensors"});
}

// ---- the corrupt set: each is bad_file with a specific word ----

TEST_F(Safetensors, RejectsEmptyAndShortFiles) {
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file("")); }, ErrorCode::bad_file, "empty"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file("\x02\0\0\0\0")); }, ErrorCode::bad_file, "too short"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(path("missing.safetensors")); }, ErrorCode::bad_file, "cannot open"));
}

// What the opened descriptor is decides (io::ReadFile), for read() and map() alike: a FIFO with no writer is refused
// at once rather than blocking for good, and a device is not read.
TEST_F(Safetensors, RejectsFifosAndDevicesWithoutBlocking) {
  const std::string fifo = path("w.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& p : {fifo, std::string("/dev/zero")}) {
    const std::string kind = p == fifo ? "(a FIFO)" : "(a device)";
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(p); }, ErrorCode::bad_file, p + ": not a regular file " + kind));
    EXPECT_TRUE(ThrowsError([&] { safetensors::map(p); }, ErrorCode::bad_file, p + ": not a regular file " + kind));
  }
}

TEST_F(Safetensors, RejectsBadHeaderLengths) {
  const std::string huge = le_bytes(std::vector<uint64_t>{uint64_t{1} << 60}) + "{}";
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(huge)); }, ErrorCode::bad_file, "limit"));
  const std::string past = le_bytes(std::vector<uint64_t>{1000}) + "{}";
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(past)); }, ErrorCode::bad_file, "past the end of the file"));
}

TEST_F(Safetensors, RejectsHeaderThatIsNotAJsonObject) {
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw("{not json", ""))); }, ErrorCode::bad_file,
                          "not valid JSON"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw("", ""))); }, ErrorCode::bad_file, "not valid JSON"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw(std::string("{}\0", 3), ""))); }, ErrorCode::bad_file,
                          "not valid JSON"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw("[1, 2]", ""))); }, ErrorCode::bad_file,
                          "not an object"));
  // A UTF-8 byte-order mark before the JSON: nlohmann would skip it, the format has none.
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw("\xEF\xBB\xBF{}", ""))); }, ErrorCode::bad_file,
                          "header is not valid JSON: it starts with a UTF-8 byte-order mark"));
}

// One tensor "t" with the given header entry over 16 data bytes.
std::string one_entry(const std::string& entry_json) { return st_raw("{\"t\": " + entry_json + "}", std::string(16, '\0')); }

TEST_F(Safetensors, RejectsMalformedEntries) {
  const std::pair<const char*, const char*> cases[] = {
      {"5", "not an object"},
      {R"({"shape": [4], "data_offsets": [0, 16]})", "missing 'dtype'"},
      {R"({"dtype": "F32", "data_offsets": [0, 16]})", "missing 'shape'"},
      {R"({"dtype": "F32", "shape": [4]})", "missing 'data_offsets'"},
      {R"({"dtype": 4, "shape": [4], "data_offsets": [0, 16]})", "'dtype' is not a string"},
      {R"({"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 16]})", "unknown dtype 'Q4_K'"},
      {R"({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]})", "not an array"},
      {R"({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]})", "negative"},
      {R"({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]})", "not a non-negative integer"},
      {R"({"dtype": "F32", "shape": [1e30], "data_offsets": [0, 16]})", "not a non-negative integer"},
      {R"({"dtype": "F32", "shape": [4], "data_offsets": [0]})", "data_offsets"},
      {R"({"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]})", "non-negative"},
      {R"({"dtype": "F32", "shape": [4], "data_offsets": "0-16"})", "data_offsets"},
  };
  for (const auto& [entry, word] : cases) {
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(one_entry(entry))); }, ErrorCode::bad_file, word)) << entry;
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(one_entry(entry))); }, ErrorCode::bad_file, "tensor 't'"))
        << entry;
  }
}

TEST_F(Safetensors, RejectsInconsistentOffsetsAndSizes) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [16, 24]})", "past the end of the data"},
      {R"({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]})", "begin 8 > end 4"},
      {R"({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]})", "needs 12 bytes but data_offsets span 8"},
      {R"({"dtype": "F16", "shape": [4], "data_offsets": [0, 16]})", "needs 8 bytes"},
      {R"({"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 16]})",
       "overflows the element count"},
      {R"({"dtype": "F64", "shape": [2147483648, 2147483648], "data_offsets": [0, 16]})",
       "overflows the byte count"},
  };
  for (const auto& [entry, word] : cases)
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(one_entry(entry))); }, ErrorCode::bad_file, word)) << entry;
}

TEST_F(Safetensors, RejectsTruncatedDataSection) {
  for (auto entry : {f32, bf16, f16}) {
    const std::string good = st_file({entry("a", {4}, 0.0f), entry("b", {2, 2}, 0.0f)});
    ASSERT_NO_THROW(safetensors::read(file(good)));
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(good.substr(0, good.size() - 2))); }, ErrorCode::bad_file,
                            "truncated"));
  }
  // Cut inside the first tensor by offset, whose name sorts last: it is the one named, not the first by name of the
  // tensors lost after it.
  const std::string three = st_file({f32("z", {4}), f32("m", {4}), f32("a", {4})});
  const size_t data_start = three.size() - 48;
  for (size_t cut : {data_start, data_start + 6}) {
    EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(three.substr(0, cut))); }, ErrorCode::bad_file,
                            "tensor 'z': data_offsets end 16 is past the end"))
        << cut;
  }
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(three.substr(0, data_start + 20))); }, ErrorCode::bad_file,
                          "tensor 'm'"));
  // A whole BF16 layer cut short in its last tensor, as a layer loader sees it.
  const std::string layer = st_file({bf16("in_proj_weight", {6, 2}), bf16("out_proj.weight", {2, 2})});
  const std::string cut = file(layer.substr(0, layer.size() - 2));
  EXPECT_TRUE(ThrowsError([&] { open_safetensors_layer(cut); }, ErrorCode::bad_file, "truncated"));
}

// A data section larger than the machine's memory is refused before it is read (a sparse file: no disk used).
TEST_F(Safetensors, RefusesADataSectionBeyondPhysicalMemory) {
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  const int64_t n = physical / 4 + (int64_t{1} << 28);  // f32 elements: 1 GiB past the physical memory
  json h = json::object();
  h["big"] = {{"dtype", "F32"}, {"shape", {n}}, {"data_offsets", {0, 4 * n}}};
  const std::string p = file(st_raw(h.dump(), ""));
  std::filesystem::resize_file(p, std::filesystem::file_size(p) + static_cast<uintmax_t>(4 * n));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(p); }, ErrorCode::out_of_memory, "physical memory"));
}

TEST_F(Safetensors, RejectsBadMetadata) {
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_file({f32("a", {1})}, {{"format", 1}}))); },
                          ErrorCode::bad_file, "__metadata__"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw(R"({"__metadata__": [1]})", ""))); },
                          ErrorCode::bad_file, "__metadata__"));
}

// The data section must be tiled exactly: sorted by begin, each tensor starts where the previous one ended, the
// first at 0, the last ends at the data size. Overlaps, gaps and trailing bytes all let two readers of the same file
// disagree about what it holds (or hide a second payload), so the reference implementation refuses them too.

// A header entry for an F32 tensor of `n` elements at [begin, begin + 4n).
json f32_at(int64_t n, uint64_t begin) {
  return {{"dtype", "F32"}, {"shape", {n}}, {"data_offsets", {begin, begin + 4 * static_cast<uint64_t>(n)}}};
}

TEST_F(Safetensors, RejectsOverlappingTensors) {
  const std::string partly = file(st_raw(json{{"a", f32_at(4, 0)}, {"b", f32_at(4, 8)}}.dump(), std::string(24, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(partly); }, ErrorCode::bad_file,
                          partly + ": tensors 'a' [0, 16) and 'b' [8, 24) overlap"));
  // Two names for the same bytes.
  const std::string same = file(st_raw(json{{"x", f32_at(4, 0)}, {"y", f32_at(4, 0)}}.dump(), std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(same); }, ErrorCode::bad_file,
                          "tensors 'x' [0, 16) and 'y' [0, 16) overlap"));
  // A long tensor covering two short ones that tile the same bytes.
  const std::string cover = file(
      st_raw(json{{"a", f32_at(2, 0)}, {"b", f32_at(2, 8)}, {"all", f32_at(4, 0)}}.dump(), std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(cover); }, ErrorCode::bad_file, "overlap"));
}

TEST_F(Safetensors, RejectsGapsBetweenTensors) {
  const std::string gap = file(st_raw(json{{"a", f32_at(2, 0)}, {"b", f32_at(2, 12)}}.dump(), std::string(20, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(gap); }, ErrorCode::bad_file,
                          gap + ": bytes [8, 12) of the data section belong to no tensor (between 'a' and 'b')"));
  const std::string lead = file(st_raw(json{{"a", f32_at(2, 4)}}.dump(), std::string(12, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(lead); }, ErrorCode::bad_file,
                          "bytes [0, 4) of the data section belong to no tensor (before 'a', the first)"));
}

TEST_F(Safetensors, RejectsTrailingBytesAfterTheLastTensor) {
  const std::string good = st_file({f32("a", {4}), f32("b", {2})});
  ASSERT_NO_THROW(safetensors::read(file(good)));
  const std::string extra = file(good + "PK\x03\x04");
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(extra); }, ErrorCode::bad_file,
                          extra + ": 4 trailing bytes after the last tensor 'b', which ends at 24 of 28"));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw("{}", "junk"))); }, ErrorCode::bad_file,
                          "4 bytes of data but the header lists no tensors"));
  const json empty = {{"e", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}}}};
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(file(st_raw(empty.dump(), "junk"))); }, ErrorCode::bad_file,
                          "4 bytes of data but every tensor in the header is empty"));
}

TEST_F(Safetensors, RejectsDuplicateHeaderKeys) {
  const std::string a = R"({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})";
  const std::string names = file(st_raw(R"({"a": )" + a + R"(, "a": )" + a + "}", std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(names); }, ErrorCode::bad_file,
                          names + ": header has duplicate key 'a'"));
  const std::string field = file(st_raw(
      R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "dtype": "F16"}})", std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(field); }, ErrorCode::bad_file,
                          "header has duplicate key 'dtype' (in 't')"));
  const std::string meta = file(st_raw(R"({"__metadata__": {"format": "pt", "format": "np"}})", ""));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(meta); }, ErrorCode::bad_file,
                          "header has duplicate key 'format' (in '__metadata__')"));
  // The same key in two different objects is not a duplicate.
  EXPECT_NO_THROW(safetensors::read(file(st_file({f32("a", {1}), f32("b", {1})}, {{"a", "x"}}))));
}

// Empty tensors hold no bytes, so several may sit at one boundary, at 0 or at the end; but the reference reader
// refuses one whose offset falls inside another tensor, and so does this one (not as an overlap: no byte is shared).
TEST_F(Safetensors, EmptyTensorsSitAtBoundariesOnly) {
  const json zero_at_8 = {{"dtype", "F32"}, {"shape", {0, 3}}, {"data_offsets", {8, 8}}};
  const json h = {{"first", {{"dtype", "F16"}, {"shape", {0}}, {"data_offsets", {0, 0}}}},
                  {"a", f32_at(2, 0)},
                  {"mid1", zero_at_8},
                  {"mid2", zero_at_8},
                  {"b", f32_at(2, 8)},
                  {"last", {{"dtype", "BF16"}, {"shape", {5, 0}}, {"data_offsets", {16, 16}}}}};
  const safetensors::File f = safetensors::read(file(st_raw(h.dump(), std::string(16, '\0'))));
  EXPECT_EQ(f.tensors.size(), 6u);
  EXPECT_TRUE(f.to_f32("mid2").empty());
  const json only = {{"only", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}}}};
  EXPECT_NO_THROW(safetensors::read(file(st_raw(only.dump(), ""))));

  const std::string inside = file(st_raw(json{{"a", f32_at(4, 0)}, {"z", zero_at_8}}.dump(), std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { safetensors::read(inside); }, ErrorCode::bad_file,
                          inside + ": empty tensor 'z' at offset 8 lies inside tensor 'a' [0, 16)"));
}

// ---- load_safetensors_layer ----

TEST_F(Safetensors, LoadsTorchFusedLayerUnderAPrefix) {
  const int64_t E = 4, d_in = 3;
  const std::string p = file(st_file({
      f32("layer0.in_proj_weight", {3 * E, d_in}, 0.0f),
      f32("layer0.in_proj_bias", {3 * E}, 100.0f),
      f32("layer0.out_proj.weight", {E, E}, 200.0f),
      f32("layer0.out_proj.bias", {E}, 300.0f),
      f32("layer0.norm.weight", {E}, -1.0f),               // not part of the layer
      f32("layer1.in_proj_weight", {3 * E, d_in}, 50.0f),  // another layer
      f32("layer1.out_proj.weight", {E, E}, 60.0f),
  }));
  for (const char* prefix : {"layer0.", "layer0"}) {
    const LoadedLayer l = load_safetensors_layer(p, prefix);
    EXPECT_EQ(l.naming, "torch");
    EXPECT_EQ(l.d_model, E);
    EXPECT_EQ(l.d_in, d_in);
    EXPECT_EQ(l.kdim, d_in);
    EXPECT_EQ(l.vdim, d_in);
    EXPECT_TRUE(l.qkv_bias);
    EXPECT_TRUE(l.out_bias);
    const Weights& w = l.weights;
    EXPECT_EQ(w.w_q, ramp(E * d_in, 0.0f)) << prefix;
    EXPECT_EQ(w.w_k, ramp(E * d_in, static_cast<float>(E * d_in))) << prefix;
    EXPECT_EQ(w.w_v, ramp(E * d_in, static_cast<float>(2 * E * d_in))) << prefix;
    EXPECT_EQ(w.b_q, ramp(E, 100.0f));
    EXPECT_EQ(w.b_k, ramp(E, 104.0f));
    EXPECT_EQ(w.b_v, ramp(E, 108.0f));
    EXPECT_EQ(w.w_o, ramp(E * E, 200.0f));
    EXPECT_EQ(w.b_o, ramp(E, 300.0f));
  }
  const LoadedLayer other = load_safetensors_layer(p, "layer1");
  EXPECT_EQ(other.weights.w_q, ramp(E * d_in, 50.0f));
  EXPECT_FALSE(other.qkv_bias);
  EXPECT_FALSE(other.out_bias);
  EXPECT_TRUE(other.weights.b_q.empty() && other.weights.b_k.empty() && other.weights.b_v.empty());
  EXPECT_TRUE(other.weights.b_o.empty());
}

TEST_F(Safetensors, LoadsTorchSeparateProjectionsWithOtherWidths) {
  const int64_t E = 4, d_in = 6, kdim = 5, vdim = 7;
  const std::string p = file(st_file({
      f32("q_proj_weight", {E, d_in}, 0.0f),
      f32("k_proj_weight", {E, kdim}, 30.0f),
      f32("v_proj_weight", {E, vdim}, 60.0f),
      f32("out_proj.weight", {E, E}, 90.0f),
  }));
  const LoadedLayer l = load_safetensors_layer(p);
  EXPECT_EQ(l.naming, "torch");
  EXPECT_EQ(l.d_model, E);
  EXPECT_EQ(l.d_in, d_in);
  EXPECT_EQ(l.kdim, kdim);
  EXPECT_EQ(l.vdim, vdim);
  EXPECT_FALSE(l.qkv_bias);
  EXPECT_FALSE(l.out_bias);
  EXPECT_EQ(l.weights.w_q, ramp(E * d_in, 0.0f));
  EXPECT_EQ(l.weights.w_k, ramp(E * kdim, 30.0f));
  EXPECT_EQ(l.weights.w_v, ramp(E * vdim, 60.0f));
  EXPECT_EQ(l.weights.w_o, ramp(E * E, 90.0f));
  EXPECT_TRUE(l.weights.b_q.empty() && l.weights.b_o.empty());

  // Separate weights still take their biases from the one in_proj_bias (3E), as torch stores them.
  const std::string pb = file(st_file({f32("q_proj_weight", {E, d_in}), f32("k_proj_weight", {E, kdim}),
                                       f32("v_proj_weight", {E, vdim}), f32("in_proj_bias", {3 * E}, 10.0f),
                                       f32("out_proj.weight", {E, E})}));
  const LoadedLayer lb = load_safetensors_layer(pb);
  EXPECT_TRUE(lb.qkv_bias);
  EXPECT_EQ(lb.weights.b_k, ramp(E, 14.0f));
}

TEST_F(Safetensors, LoadsTorchLayerStoredInBf16) {
  const int64_t E = 2;
  const std::string p = file(st_file({bf16("in_proj_weight", {3 * E, E}, -6.0f), bf16("out_proj.weight", {E, E}, 1.0f),
                                      bf16("out_proj.bias", {E}, -100.0f)}));
  const LoadedLayer l = load_safetensors_layer(p);
  EXPECT_EQ(l.weights.w_q, ramp(E * E, -6.0f));
  EXPECT_EQ(l.weights.w_v, ramp(E * E, 2.0f));
  EXPECT_EQ(l.weights.w_o, ramp(E * E, 1.0f));
  EXPECT_EQ(l.weights.b_o, ramp(E, -100.0f));
}

// W[i][j] = 100 i + j (Conv1D layout, (in, out)); the loader must produce torch layout [out][in].
void expect_hf_layer(const LoadedLayer& l, int64_t E, int64_t d_in, float c_attn_base, float c_proj_base) {
  EXPECT_EQ(l.naming, "hf-gpt2");
  EXPECT_EQ(l.d_model, E);
  EXPECT_EQ(l.d_in, d_in);
  EXPECT_EQ(l.kdim, d_in);
  EXPECT_EQ(l.vdim, d_in);
  const Weights& w = l.weights;
  ASSERT_EQ(w.w_q.size(), static_cast<size_t>(E * d_in));
  ASSERT_EQ(w.w_o.size(), static_cast<size_t>(E * E));
  const auto W = [&](int64_t i, int64_t j) { return c_attn_base + static_cast<float>(i * 3 * E + j); };
  const auto P = [&](int64_t i, int64_t o) { return c_proj_base + static_cast<float>(i * E + o); };
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < d_in; ++i) {
      EXPECT_EQ(w.w_q[e * d_in + i], W(i, e)) << "w_q e=" << e << " i=" << i;
      EXPECT_EQ(w.w_k[e * d_in + i], W(i, E + e)) << "w_k e=" << e << " i=" << i;
      EXPECT_EQ(w.w_v[e * d_in + i], W(i, 2 * E + e)) << "w_v e=" << e << " i=" << i;
    }
  for (int64_t o = 0; o < E; ++o)
    for (int64_t i = 0; i < E; ++i) EXPECT_EQ(w.w_o[o * E + i], P(i, o)) << "w_o o=" << o << " i=" << i;
}

TEST_F(Safetensors, LoadsHfGpt2LayerWithConv1dTranspose) {
  const int64_t E = 4, d_in = 3;
  const std::string p = file(st_file(
      {
          f32("h.3.attn.c_attn.weight", {d_in, 3 * E}, 0.0f),
          f32("h.3.attn.c_attn.bias", {3 * E}, 1000.0f),
          f32("h.3.attn.c_proj.weight", {E, E}, 2000.0f),
          f32("h.3.attn.c_proj.bias", {E}, 3000.0f),
          {"h.3.attn.bias", "BOOL", {1, 1, 4, 4}, std::string(16, '\1')},  // the checkpoint's causal buffer
          f32("h.3.ln_1.weight", {E}),
          f32("h.2.attn.c_attn.weight", {d_in, 3 * E}, 500.0f),
      },
      {{"format", "pt"}}));
  for (const char* prefix : {"h.3.attn.", "h.3.attn"}) {
    const LoadedLayer l = load_safetensors_layer(p, prefix);
    expect_hf_layer(l, E, d_in, 0.0f, 2000.0f);
    EXPECT_TRUE(l.qkv_bias);
    EXPECT_TRUE(l.out_bias);
    EXPECT_EQ(l.weights.b_q, ramp(E, 1000.0f));
    EXPECT_EQ(l.weights.b_k, ramp(E, 1004.0f));
    EXPECT_EQ(l.weights.b_v, ramp(E, 1008.0f));
    EXPECT_EQ(l.weights.b_o, ramp(E, 3000.0f));
  }
}

TEST_F(Safetensors, LoadsHfGpt2LayerStoredInF16WithoutBiases) {
  const int64_t E = 2, d_in = 2;
  const std::string p = file(st_file({f16("c_attn.weight", {d_in, 3 * E}, -5.0f), f16("c_proj.weight", {E, E}, 7.0f)}));
  const LoadedLayer l = load_safetensors_layer(p);
  expect_hf_layer(l, E, d_in, -5.0f, 7.0f);
  EXPECT_FALSE(l.qkv_bias);
  EXPECT_FALSE(l.out_bias);
  EXPECT_TRUE(l.weights.b_q.empty() && l.weights.b_o.empty());
}

TEST_F(Safetensors, ApplyLoadedShapesCompletesTheConfig) {
  const int64_t E = 4;
  const std::string p = file(st_file({f32("q_proj_weight", {E, 6}), f32("k_proj_weight", {E, 5}),
                                      f32("v_proj_weight", {E, 7}), f32("out_proj.weight", {E, E})}));
  Config c;
  c.num_heads = 2;
  c.causal = true;
  c.context_length = 77;
  const Config r = apply_loaded_shapes(c, load_safetensors_layer(p));
  EXPECT_EQ(r.d_model, E);
  EXPECT_EQ(r.d_in, 6);
  EXPECT_EQ(r.kdim, 5);
  EXPECT_EQ(r.vdim, 7);
  EXPECT_FALSE(r.qkv_bias);
  EXPECT_FALSE(r.out_bias);
  EXPECT_EQ(r.num_heads, 2);
  EXPECT_TRUE(r.causal);
  EXPECT_EQ(r.context_length, 77);
}

// Grouped-query checkpoints: K and V have KW = H_kv * D rows. E = 8, D = 2 (4 heads), KW = 4 (2 K/V heads), in each
// layout the loader takes; the rows are split at E and E + KW, and the K/V head count comes from the file unless the
// config names one, which must then agree.
TEST_F(Safetensors, GroupedKvHeadsLoadInEveryLayout) {
  const int64_t E = 8, KW = 4, d_in = 3;
  const std::vector<std::vector<Entry>> layouts = {
      {f32("in_proj_weight", {E + 2 * KW, d_in}), f32("in_proj_bias", {E + 2 * KW}, 500),
       f32("out_proj.weight", {E, E})},
      {f32("q_proj_weight", {E, d_in}), f32("k_proj_weight", {KW, d_in}, E * d_in),
       f32("v_proj_weight", {KW, d_in}, (E + KW) * d_in), f32("in_proj_bias", {E + 2 * KW}, 500),
       f32("out_proj.weight", {E, E})},
      {f32("c_attn.weight", {d_in, E + 2 * KW}), f32("c_attn.bias", {E + 2 * KW}, 500),
       f32("c_proj.weight", {E, E})},
  };
  for (size_t i = 0; i < layouts.size(); ++i) {
    const LoadedLayer l = load_safetensors_layer(file(st_file(layouts[i])));
    EXPECT_EQ(l.kv_width, KW) << "layout " << i;
    ASSERT_EQ(l.weights.w_k.size(), static_cast<size_t>(KW * d_in)) << "layout " << i;
    ASSERT_EQ(l.weights.w_v.size(), static_cast<size_t>(KW * d_in)) << "layout " << i;
    // Rows E..E+KW of the fused [q | k | v] are K, the next KW are V (torch layout after the Conv1D transpose).
    for (int64_t r = 0; r < KW; ++r) {
      for (int64_t c = 0; c < d_in; ++c) {
        const float k = i == 2 ? static_cast<float>(c * (E + 2 * KW) + E + r) : static_cast<float>((E + r) * d_in + c);
        const float v = i == 2 ? static_cast<float>(c * (E + 2 * KW) + E + KW + r)
                               : static_cast<float>((E + KW + r) * d_in + c);
        EXPECT_EQ(l.weights.w_k[r * d_in + c], k) << "layout " << i << " K row " << r << " col " << c;
        EXPECT_EQ(l.weights.w_v[r * d_in + c], v) << "layout " << i << " V row " << r << " col " << c;
      }
    }
    EXPECT_EQ(l.weights.b_k.front(), 500.0f + E) << "layout " << i;
    EXPECT_EQ(l.weights.b_v.front(), 500.0f + E + KW) << "layout " << i;

    Config c;
    c.num_heads = 4;
    const Config inferred = apply_loaded_shapes(c, l);
    EXPECT_EQ(inferred.kv_heads(), 2) << "layout " << i;
    EXPECT_NO_THROW(l.weights.validate(inferred)) << "layout " << i;
    c.num_kv_heads = 4;  // plain multi-head: the file's K/V are too narrow
    EXPECT_TRUE(ThrowsError([&] { apply_loaded_shapes(c, l); }, ErrorCode::invalid_argument, "set num_kv_heads to 2"))
        << "layout " << i;
    c.num_kv_heads = 0;
    c.num_heads = 8;  // D = 1: KW = 4 would be 4 K/V heads, fine; 3 heads cannot divide E = 8 at all
    EXPECT_EQ(apply_loaded_shapes(c, l).kv_heads(), 4) << "layout " << i;
    c.num_heads = 3;
    EXPECT_TRUE(ThrowsError([&] { apply_loaded_shapes(c, l); }, ErrorCode::invalid_argument, "does not divide"))
        << "layout " << i;
  }
}

TEST_F(Safetensors, WrongPrefixListsTheNamesPresent) {
  const std::string p = file(st_file({f32("h.3.attn.c_attn.weight", {4, 12}), f32("h.3.attn.c_proj.weight", {4, 4}),
                                      f32("h.3.ln_1.weight", {4})}));
  EXPECT_TRUE(ThrowsError([&] { load_safetensors_layer(p, "h.7.attn."); }, ErrorCode::bad_file, "no attention layer"));
  EXPECT_TRUE(ThrowsError([&] { load_safetensors_layer(p, "h.7.attn."); }, ErrorCode::bad_file,
                          "h.3.attn.c_attn.weight"));
  EXPECT_TRUE(ThrowsError([&] { load_safetensors_layer(p); }, ErrorCode::bad_file, "c_attn.weight"));
  EXPECT_TRUE(ThrowsError([&] { load_safetensors_layer(file(st_raw("{}", ""))); }, ErrorCode::bad_file, "no tensors"));
}

TEST_F(Safetensors, RejectsLayerShapesThatDisagree) {
  const int64_t E = 4;
  struct Case {
    std::vector<Entry> entries;
    const char* word;
  };
  const std::vector<Case> cases = {
      {{f32("in_proj_weight", {11, E}), f32("out_proj.weight", {E, E})}, "not E + 2 x a K/V width"},
      {{f32("in_proj_weight", {E, E}), f32("out_proj.weight", {E, E})}, "not E + 2 x a K/V width"},
      {{f32("in_proj_weight", {3, E, E}), f32("out_proj.weight", {E, E})}, "rank 2"},
      {{f32("in_proj_weight", {3 * E, E}), f32("out_proj.weight", {E, E + 1})}, "'out_proj.weight' has shape [4, 5], expected [4, 4]"},
      {{f32("in_proj_weight", {3 * E, E})}, "missing tensor 'out_proj.weight'"},
      {{f32("out_proj.weight", {E, E})}, "missing tensor 'in_proj_weight'"},
      {{f32("in_proj_weight", {3 * E, E}), f32("in_proj_bias", {11}), f32("out_proj.weight", {E, E})}, "in_proj_bias"},
      {{f32("in_proj_weight", {3 * E, E}), f32("out_proj.weight", {E, E}), f32("out_proj.bias", {3})}, "out_proj.bias"},
      {{f32("q_proj_weight", {E, 6}), f32("k_proj_weight", {3, 5}), f32("v_proj_weight", {E, 7}),
        f32("out_proj.weight", {E, E})},
       "'v_proj_weight' has shape [4, 7], expected [3, 7]"},
      {{f32("q_proj_weight", {E, 6}), f32("k_proj_weight", {E, 5}), f32("out_proj.weight", {E, E})},
       "missing tensor 'v_proj_weight'"},
      {{f32("in_proj_weight", {3 * E, E}), f32("q_proj_weight", {E, E}), f32("out_proj.weight", {E, E})}, "ambiguous"},
      {{f32("in_proj_weight", {3 * E, E}), f32("out_proj.weight", {E, E}), f32("bias_k", {1, 1, E})}, "add_bias_kv"},
      {{f32("c_attn.weight", {E, 11}), f32("c_proj.weight", {E, E})}, "not E + 2 x a K/V width"},
      {{f32("c_attn.weight", {E, 3 * E}), f32("c_proj.weight", {E, 3})}, "'c_proj.weight' has shape [4, 3]"},
      {{f32("c_attn.weight", {E, 3 * E}), f32("c_attn.bias", {E}), f32("c_proj.weight", {E, E})}, "c_attn.bias"},
      {{f32("c_attn.weight", {E, 3 * E}), f32("c_proj.weight", {E, E}), f32("c_proj.bias", {2 * E})}, "c_proj.bias"},
      {{f32("c_attn.weight", {E, 3 * E}), f32("c_proj.weight", {E, E}), f32("out_proj.weight", {E, E})}, "both"},
      {{f32("c_attn.weight", {0, 3 * E}), f32("c_proj.weight", {E, E})}, "non-empty"},
      {{{"in_proj_weight", "I64", {3 * E, E}, std::string(3 * E * E * 8, '\0')}, f32("out_proj.weight", {E, E})},
       "dtype I64"},
  };
  for (const Case& c : cases) {
    const std::string p = file(st_file(c.entries));
    EXPECT_TRUE(ThrowsError([&] { load_safetensors_layer(p); }, ErrorCode::bad_file, c.word)) << c.word;
  }
}

// ---- open_safetensors_layer: a layer built from the file's bytes as stored ----

// `n` random values in [-scale, scale) as `dtype` bytes (each value representable in it, so the file holds exactly
// those values): the layer from the stored bytes and the layer from their exact f32 copy see the same numbers.
Entry random_entry(const std::string& name, const char* dtype, const std::vector<int64_t>& shape, std::mt19937& rng,
                   float scale = 0.5f) {
  std::uniform_real_distribution<float> u(-scale, scale);
  const int64_t n = numel(shape);
  if (std::string(dtype) == "F32") {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return {name, dtype, shape, le_bytes(v)};
  }
  std::vector<uint16_t> h(n);
  for (uint16_t& x : h) {
    const float v = u(rng);
    // f16 by its exact small-integer encoding: v * 1024 rounded is an integer of magnitude < 2048 (exact in f16),
    // stored as that integer scaled by 2^-10 (the exponent lowered by 10).
    const float q = std::nearbyint(v * 1024.0f);
    const uint16_t as_int = to_f16(q);
    const uint16_t scaled = q == 0.0f ? as_int : static_cast<uint16_t>(as_int - (10u << 10));
    x = std::string(dtype) == "BF16" ? kernels::to_bf16(v).bits : scaled;
  }
  return {name, dtype, shape, le_bytes(h)};
}

TEST_F(Safetensors, LayerFromStoredTensorsEqualsLayerFromTheirF32Copy) {
  // E = 48, H = 4 (D = 12): every layout, stored dtype and compute type; with a 1-byte tensor first, every tensor
  // is unaligned (read through copies), without it oneDNN reorders the stored bytes through their strides.
  const int64_t E = 48, H = 4, B = 2, T = 9;
  std::mt19937 rng(7);
  std::vector<float> x(B * T * E);
  for (float& v : x) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  for (const char* dtype : {"F32", "BF16", "F16"}) {
    for (const char* layout : {"torch-fused", "torch-separate", "hf-gpt2"}) {
      for (bool unaligned : {false, true}) {
        std::vector<Entry> entries;
        if (unaligned) entries.push_back({"pad", "U8", {1}, std::string(1, '\0')});
        const std::string L(layout);
        if (L == "torch-fused") {
          entries.push_back(random_entry("in_proj_weight", dtype, {3 * E, E}, rng));
          entries.push_back(random_entry("in_proj_bias", dtype, {3 * E}, rng));
        } else if (L == "torch-separate") {
          for (const char* n : {"q_proj_weight", "k_proj_weight", "v_proj_weight"})
            entries.push_back(random_entry(n, dtype, {E, E}, rng));
        } else {
          entries.push_back(random_entry("c_attn.weight", dtype, {E, 3 * E}, rng));
          entries.push_back(random_entry("c_attn.bias", dtype, {3 * E}, rng));
        }
        entries.push_back(random_entry(L == "hf-gpt2" ? "c_proj.weight" : "out_proj.weight", dtype, {E, E}, rng));
        entries.push_back(random_entry(L == "hf-gpt2" ? "c_proj.bias" : "out_proj.bias", dtype, {E}, rng));
        const std::string p = file(st_file(entries));

        Config c;
        c.num_heads = H;
        c.context_length = 64;
        c.causal = true;
        const Config cfg = apply_loaded_shapes(c, load_safetensors_layer(p));
        const Weights copy = load_safetensors_layer(p).weights;
        for (DType compute : {DType::f32, DType::bf16}) {
          for (Isa isa : compiled_isas()) {
            if (!isa_supported(isa)) continue;  // a level this CPU lacks is refused at construction
            const std::string what = std::string(dtype) + " " + layout + (unaligned ? " unaligned" : "") + " " +
                                     to_string(compute) + " " + to_string(isa);
            const EngineOptions o{1, isa, compute};
            // The stored layer is built and its file bytes freed before it runs: it keeps nothing of the views.
            CausalSelfAttention stored = [&] {
              const StoredLayer s = open_safetensors_layer(p);
              return CausalSelfAttention(cfg, s.weights, o);
            }();
            CausalSelfAttention from_copy(cfg, copy, o);
            std::vector<float> y1(B * T * E), y2(B * T * E);
            stored.forward(x.data(), B, T, y1.data());
            from_copy.forward(x.data(), B, T, y2.data());
            ASSERT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0) << "forward, " << what;
            // Decode reads its own panel-packed copy of the weights.
            KvCache k1(cfg, {16, 64, 0, DType::f32}), k2(cfg, {16, 64, 0, DType::f32});
            const SequenceId s1 = k1.create(), s2 = k2.create();
            stored.extend(k1, s1, x.data(), T, y1.data());
            from_copy.extend(k2, s2, x.data(), T, y2.data());
            stored.decode(k1, &s1, 1, x.data() + T * E, y1.data());
            from_copy.decode(k2, &s2, 1, x.data() + T * E, y2.data());
            ASSERT_EQ(std::memcmp(y1.data(), y2.data(), E * 4), 0) << "decode, " << what;
          }
        }
      }
    }
  }
}

TEST_F(Safetensors, StoredLayerViewsMatchTheFileAndRefuseOtherDtypes) {
  const int64_t E = 4;
  const std::string p = file(st_file({bf16("c_attn.weight", {E, 3 * E}), f16("c_proj.weight", {E, E}, 1.0f)}));
  const StoredLayer s = open_safetensors_layer(p);
  EXPECT_EQ(s.naming, "hf-gpt2");
  EXPECT_EQ(s.weights.w_q.dtype, DType::bf16);
  EXPECT_EQ(s.weights.w_o.dtype, DType::f16);
  // Conv1D: W_q is the (E, d_in) view of c_attn's first E columns, strides (1, 3E).
  EXPECT_EQ(s.weights.w_q.shape_str(), "(4, 4)");
  EXPECT_EQ(s.weights.w_q.strides[0], 1);
  EXPECT_EQ(s.weights.w_q.strides[1], 3 * E);
  EXPECT_TRUE(s.weights.b_q.empty() && s.weights.b_o.empty());
  Config c;
  c.num_heads = 2;
  const Config cfg = apply_loaded_shapes(c, s);
  EXPECT_NO_THROW(s.weights.validate(cfg));
  WeightsView bad = s.weights;
  bad.w_k.dtype = DType::i8;
  EXPECT_TRUE(ThrowsError([&] { bad.validate(cfg); }, ErrorCode::invalid_argument, "w_k has dtype i8"));
  bad = s.weights;
  bad.w_v.shape[1] = 3;
  EXPECT_TRUE(ThrowsError([&] { MultiHeadAttention(cfg, bad); }, ErrorCode::invalid_argument,
                          "w_v has shape (4, 3), expected (4, 4)"));
  bad = s.weights;
  bad.w_o = TensorView{};
  EXPECT_TRUE(ThrowsError([&] { MultiHeadAttention(cfg, bad); }, ErrorCode::invalid_argument, "w_o is missing"));
}

}  // namespace
}  // namespace gpt2attn
