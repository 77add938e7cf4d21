// tests/test_npy.cpp: the .npy reader and writer: round trips, hand-built files in every accepted dtype and
// header version, and one test per rejection class. Byte-level files are built here, not with numpy.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "tools/npy.hpp"
#include "tests/file_test_util.hpp"

namespace gpt2attn {
namespace {

using testutil::le_bytes;
using testutil::ThrowsError;
using testutil::write_bytes;

class Npy : public testutil::TempDirTest {};

std::string dict(const std::string& descr, const std::string& shape, const std::string& fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

// A complete .npy file around `header` (padded like numpy), with the given format version.
std::string npy_file(std::string header, const std::string& payload, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t len = static_cast<uint32_t>(header.size());
  out += le_bytes(std::vector<uint32_t>{len}).substr(0, major == 1 ? 2 : 4);
  return out + header + payload;
}

std::vector<float> distinct_values(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) / 3.0f - 7.25f;
  return v;
}

TEST_F(Npy, RoundTripsEveryRank) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {3, 4}, {2, 1, 3}, {2, 3, 4, 5}, {0, 3}};
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const std::vector<float> values = distinct_values(n);
    const std::string p = path("a.npy");
    npy::write_f32(p, values.data(), shape);
    const npy::Array a = npy::read(p);
    EXPECT_EQ(a.kind, npy::Kind::f32);
    EXPECT_EQ(a.descr, "<f4");
    EXPECT_EQ(a.shape, shape);
    EXPECT_EQ(a.numel(), n);
    ASSERT_EQ(a.f32.size(), values.size());
    EXPECT_TRUE(values.empty() || std::memcmp(a.f32.data(), values.data(), values.size() * 4) == 0)
        << "rank " << shape.size();
    EXPECT_TRUE(a.u8.empty());
  }
}

TEST_F(Npy, WriteProducesAlignedVersion1HeaderAndNoTemporaries) {
  const std::vector<float> values = distinct_values(12);
  npy::write_f32(path("a.npy"), values.data(), {3, 4});
  const std::string bytes = testutil::read_bytes(path("a.npy"));
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 6), std::string("\x93NUMPY", 6));
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[7], 0);
  const size_t header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
  const size_t data_start = 10 + header_len;
  EXPECT_EQ(data_start % 64, 0u);
  EXPECT_EQ(bytes[data_start - 1], '\n');
  EXPECT_NE(bytes.find("'shape': (3, 4)"), std::string::npos);
  EXPECT_EQ(bytes.size(), data_start + 48);
  EXPECT_EQ(listing(), std::vector<std::string>{"a.npy"});
}

TEST_F(Npy, WriteReplacesAnExistingFile) {
  const std::vector<float> big = distinct_values(100), small = distinct_values(2);
  npy::write_f32(path("a.npy"), big.data(), {100});
  npy::write_f32(path("a.npy"), small.data(), {2, 1});
  const npy::Array a = npy::read(path("a.npy"));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(a.f32, small);
  EXPECT_EQ(listing(), std::vector<std::string>{"a.npy"});
}

TEST_F(Npy, WriteFailureLeavesNothingBehind) {
  const float x = 1.0f;
  EXPECT_TRUE(ThrowsError([&] { npy::write_f32(path("missing_dir/a.npy"), &x, {1}); }, ErrorCode::bad_file,
                          "missing_dir/a.npy"));
  // The rename fails when the target is a directory; the temporary must be removed.
  std::filesystem::create_directory(path("target"));
  EXPECT_TRUE(ThrowsError([&] { npy::write_f32(path("target"), &x, {1}); }, ErrorCode::bad_file, "rename"));
  EXPECT_EQ(listing(), std::vector<std::string>{"target"});
}

TEST_F(Npy, WriteRejectsCallerMistakes) {
  const float x = 1.0f;
  EXPECT_TRUE(ThrowsError([&] { npy::write_f32(path("a.npy"), &x, {2, -1}); }, ErrorCode::invalid_argument,
                          "negative"));
  EXPECT_TRUE(ThrowsError([&] { npy::write_f32(path("a.npy"), nullptr, {2}); }, ErrorCode::invalid_argument, "null"));
  EXPECT_TRUE(listing().empty());
}

TEST_F(Npy, ReadsFloat64) {
  const std::vector<double> d = {0.1, -2.5, 1e30, 0.0};
  write_bytes(path("a.npy"), npy_file(dict("<f8", "(2, 2)"), le_bytes(d)));
  const npy::Array a = npy::read(path("a.npy"));
  EXPECT_EQ(a.kind, npy::Kind::f32);
  EXPECT_EQ(a.descr, "<f8");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a.f32, (std::vector<float>{0.1f, -2.5f, 1e30f, 0.0f}));
}

// A finite float64 beyond float32's range is refused naming the element, rather than read as an infinity the file
// does not hold (which the finiteness check then reported as "+Inf"); float64 infinities and NaN stay what they are.
TEST_F(Npy, RejectsFloat64BeyondFloat32Range) {
  write_bytes(path("a.npy"), npy_file(dict("<f8", "(4,)"), le_bytes(std::vector<double>{1.0, 2.0, -3e300, 4.0})));
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "element 2 (flat index) is -3e+300"));
  const std::vector<double> specials = {INFINITY, -INFINITY, NAN, 3.4028234663852886e38};
  write_bytes(path("b.npy"), npy_file(dict("<f8", "(4,)"), le_bytes(specials)));
  const npy::Array b = npy::read(path("b.npy"));
  EXPECT_EQ(b.f32[0], INFINITY);
  EXPECT_EQ(b.f32[1], -INFINITY);
  EXPECT_TRUE(std::isnan(b.f32[2]));
  EXPECT_EQ(b.f32[3], std::numeric_limits<float>::max());
}

TEST_F(Npy, ReadsFloat16IncludingSubnormalsAndSpecials) {
  const std::vector<uint16_t> h = {0x3C00, 0xC000, 0x0001, 0x03FF, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x3555};
  write_bytes(path("a.npy"), npy_file(dict("<f2", "(10,)"), le_bytes(h)));
  const npy::Array a = npy::read(path("a.npy"));
  ASSERT_EQ(a.f32.size(), 10u);
  EXPECT_EQ(a.f32[0], 1.0f);
  EXPECT_EQ(a.f32[1], -2.0f);
  EXPECT_EQ(a.f32[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(a.f32[3], std::ldexp(1023.0f, -24));
  EXPECT_EQ(a.f32[4], 65504.0f);
  EXPECT_EQ(a.f32[5], std::numeric_limits<float>::infinity());
  EXPECT_EQ(a.f32[6], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(a.f32[7]));
  EXPECT_EQ(a.f32[8], 0.0f);
  EXPECT_TRUE(std::signbit(a.f32[8]));
  EXPECT_EQ(a.f32[9], 0.333251953125f);
}

TEST_F(Npy, ReadsNativeOrderFloat32) {
  const std::vector<float> v = {1.5f, -3.0f};
  write_bytes(path("a.npy"), npy_file(dict("=f4", "(2,)"), le_bytes(v)));
  EXPECT_EQ(npy::read(path("a.npy")).f32, v);
}

TEST_F(Npy, ReadsBoolNormalisedAndUint8Verbatim) {
  write_bytes(path("b.npy"), npy_file(dict("|b1", "(2, 2)"), std::string("\x00\x01\x02\xff", 4)));
  const npy::Array b = npy::read(path("b.npy"));
  EXPECT_EQ(b.kind, npy::Kind::u8);
  EXPECT_EQ(b.descr, "|b1");
  EXPECT_EQ(b.u8, (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_TRUE(b.f32.empty());

  write_bytes(path("u.npy"), npy_file(dict("|u1", "(3,)"), std::string("\x00\x07\xff", 3)));
  const npy::Array u = npy::read(path("u.npy"));
  EXPECT_EQ(u.kind, npy::Kind::u8);
  EXPECT_EQ(u.u8, (std::vector<uint8_t>{0, 7, 255}));
}

TEST_F(Npy, ReadsFormatVersions2And3) {
  const std::vector<float> v = {4.0f, 5.0f, 6.0f};
  for (int major : {2, 3}) {
    write_bytes(path("a.npy"), npy_file(dict("<f4", "(1, 3)"), le_bytes(v), major));
    const npy::Array a = npy::read(path("a.npy"));
    EXPECT_EQ(a.shape, (std::vector<int64_t>{1, 3})) << "version " << major;
    EXPECT_EQ(a.f32, v) << "version " << major;
  }
}

TEST_F(Npy, AcceptsHeaderSpellingVariants) {
  const std::vector<float> v = {7.0f};
  const std::vector<std::string> headers = {
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": ()}",  // double quotes, no trailing comma
      "{'shape': (), 'fortran_order': False, 'descr': '<f4'}",          // any key order
      "{ 'descr' : '<f4' ,'fortran_order':False,'shape':( ) , }",       // odd spacing
  };
  for (const std::string& h : headers) {
    write_bytes(path("a.npy"), npy_file(h, le_bytes(v)));
    const npy::Array a = npy::read(path("a.npy"));
    EXPECT_TRUE(a.shape.empty()) << h;
    EXPECT_EQ(a.numel(), 1) << h;
    EXPECT_EQ(a.f32, v) << h;
  }
  write_bytes(path("b.npy"), npy_file(dict("<f4", "(1, 1, 1,)"), le_bytes(v)));
  EXPECT_EQ(npy::read(path("b.npy")).shape, (std::vector<int64_t>{1, 1, 1}));
}

TEST_F(Npy, RejectsMissingFile) {
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("nope.npy")); }, ErrorCode::bad_file, "cannot open"));
  EXPECT_TRUE(ThrowsError([&] { npy::read(dir_.string()); }, ErrorCode::bad_file, "not a regular file (a directory)"));
}

// What the opened descriptor is decides (io::ReadFile): a FIFO with no writer is refused at once rather than
// blocking the read for good, and a device is not read.
TEST_F(Npy, RejectsFifosAndDevicesWithoutBlocking) {
  const std::string fifo = path("q.npy");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(ThrowsError([&] { npy::read(fifo); }, ErrorCode::bad_file, fifo + ": not a regular file (a FIFO)"));
  EXPECT_TRUE(ThrowsError([&] { npy::read("/dev/zero"); }, ErrorCode::bad_file, "not a regular file (a device)"));
}

TEST_F(Npy, RejectsBadMagic) {
  const std::string good = npy_file(dict("<f4", "(1,)"), le_bytes(std::vector<float>{1.0f}));
  std::string bad = good;
  bad[1] = 'X';
  write_bytes(path("a.npy"), bad);
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "bad magic"));
  write_bytes(path("b.npy"), "");
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("b.npy")); }, ErrorCode::bad_file, "bad magic"));
  write_bytes(path("c.npy"), "PK\x03\x04 a zip file, maybe an .npz");
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("c.npy")); }, ErrorCode::bad_file, "bad magic"));
}

TEST_F(Npy, RejectsUnknownVersion) {
  std::string bytes = npy_file(dict("<f4", "(1,)"), le_bytes(std::vector<float>{1.0f}));
  bytes[6] = 4;
  write_bytes(path("a.npy"), bytes);
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "version 4.0"));
}

TEST_F(Npy, RejectsTruncatedHeader) {
  const std::string good = npy_file(dict("<f4", "(1,)"), le_bytes(std::vector<float>{1.0f}));
  for (size_t keep : {7, 9, 40}) {
    write_bytes(path("a.npy"), good.substr(0, keep));
    EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "truncated header"))
        << keep << " bytes";
  }
}

TEST_F(Npy, RejectsTruncatedPayload) {
  write_bytes(path("q.npy"), npy_file(dict("<f4", "(3, 4)"), std::string(20, '\0')));
  const auto r = ThrowsError([&] { npy::read(path("q.npy")); }, ErrorCode::bad_file,
                             "truncated payload: header says 3x4 float32 (48 bytes) but 20 bytes follow");
  EXPECT_TRUE(r);
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("q.npy")); }, ErrorCode::bad_file, "q.npy"));
}

TEST_F(Npy, RejectsTrailingBytes) {
  write_bytes(path("a.npy"), npy_file(dict("<f4", "(2,)"), std::string(12, '\0')));
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "trailing bytes"));
}

TEST_F(Npy, RejectsFortranOrder) {
  write_bytes(path("a.npy"), npy_file(dict("<f4", "(2, 2)", "True"), std::string(16, '\0')));
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "fortran_order"));
}

TEST_F(Npy, RejectsBigEndian) {
  write_bytes(path("a.npy"), npy_file(dict(">f4", "(2,)"), std::string(8, '\0')));
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "big-endian"));
}

TEST_F(Npy, RejectsUnsupportedDtypes) {
  for (const char* descr : {"<i4", "<c8", "|O", "<U3", "|i1", "|f4", "<f16"}) {
    write_bytes(path("a.npy"), npy_file(dict(descr, "(1,)"), std::string(4, '\0')));
    EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, "unsupported dtype")) << descr;
  }
  write_bytes(path("s.npy"), npy_file("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }",
                                      std::string(4, '\0')));
  EXPECT_TRUE(ThrowsError([&] { npy::read(path("s.npy")); }, ErrorCode::bad_file, "structured"));
}

TEST_F(Npy, RejectsBadShapes) {
  const std::pair<const char*, const char*> cases[] = {
      {"(-1, 3)", "negative"},
      {"(99999999999999999999,)", "overflows int64"},
      {"(4294967296, 4294967296, 4)", "overflows"},  // numel 2^66
      {"(4611686018427387904,)", "overflows the byte count"},  // 2^62 elements * 4 bytes
      {"(5)", "not a tuple"},
      {"(3, x)", "expected an integer"},
      {"[3]", "expected '('"},
  };
  for (const auto& [shape, word] : cases) {
    write_bytes(path("a.npy"), npy_file(dict("<f4", shape), std::string(12, '\0')));
    EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, word)) << shape;
  }
}

TEST_F(Npy, RejectsMalformedHeaderDicts) {
  const std::pair<const char*, const char*> cases[] = {
      {"{'descr': '<f4', 'fortran_order': False}", "missing 'shape'"},
      {"{'descr': '<f4', 'shape': (1,)}", "missing 'fortran_order'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}", "unexpected key 'extra'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}", "duplicate key"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (1,)}", "True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", "expected ',' or '}'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} junk", "after the closing"},
      {"{'descr: '<f4', 'fortran_order': False, 'shape': (1,)}", "bad header"},
      {"", "expected '{'"},
  };
  for (const auto& [header, word] : cases) {
    write_bytes(path("a.npy"), npy_file(header, std::string(4, '\0')));
    EXPECT_TRUE(ThrowsError([&] { npy::read(path("a.npy")); }, ErrorCode::bad_file, word)) << header;
  }
}

}  // namespace
}  // namespace gpt2attn
