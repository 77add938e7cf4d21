// tests/test_config_files.cpp: the config readers (engine/config.cpp) on files and texts they must refuse: a key given
// twice, a NUL byte, a path that is not a regular file or is too large, a Hugging Face GPT-2 config whose attention
// is not the one gpt2attn computes, numbers whose range was judged after a wrap or a narrowing. And that every
// shipped config, every preset and a real Hugging Face GPT-2 config.json still load.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/error.hpp"
#include "tests/file_test_util.hpp"

namespace gpt2attn {
namespace {

namespace fs = std::filesystem;
using testutil::ThrowsError;
using testutil::write_bytes;

const fs::path kSourceDir = fs::path(__FILE__).parent_path().parent_path();

// A Hugging Face GPT-2 config.json as transformers writes it for gpt2 (the small model), with `extra` keys added.
std::string hf_config(const std::string& extra = "") {
  return R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true,
    "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},)" +
         extra + R"( "vocab_size": 50257})";
}

class ConfigFiles : public testutil::TempDirTest {
 protected:
  std::string file(const std::string& name, const std::string& text) {
    const std::string p = path(name);
    write_bytes(p, text);
    return p;
  }
};

// Defect 1: {"num_heads": 4, "num_heads": 2} loaded as 2 heads, the last key silently winning.
TEST_F(ConfigFiles, KeyGivenTwiceIsRefused) {
  const std::string ours = file("dup.json", R"({"d_model": 8, "num_heads": 4, "num_heads": 2})");
  EXPECT_TRUE(ThrowsError([&] { load_config(ours); }, ErrorCode::bad_file, ours + ": key 'num_heads' given twice"));
  EXPECT_TRUE(ThrowsError([&] { load_any_config(ours); }, ErrorCode::bad_file, ours + ": key 'num_heads' given twice"));
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "d_model": 8, "num_heads": 2})", "t"); },
                          ErrorCode::bad_file, "t: key 'd_model' given twice"));

  const std::string hf = file("hf_dup.json", hf_config(R"("n_head": 6,)"));
  EXPECT_TRUE(ThrowsError([&] { load_any_config(hf); }, ErrorCode::bad_file, hf + ": key 'n_head' given twice"));
  EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json(hf_config(R"("n_head": 12,)"), "hf"); }, ErrorCode::bad_file,
                          "hf: key 'n_head' given twice"));
  // Inside a nested object too, named by where it is; the same key in two different objects is fine.
  EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json(hf_config(R"("x": [{"a": {"k": 1, "k": 2}}],)"), "hf"); },
                          ErrorCode::bad_file, "hf: key 'k' given twice (in 'x.a')"));
  EXPECT_EQ(
      hf_gpt2_config_from_json(hf_config(R"("x": {"n_head": 1, "y": {"n_head": 2}}, "z": [{"n_head": 3}],)")).num_heads,
      12);
}

// Defect 2: '{...}\0garbage' loaded: nlohmann stops at a NUL as at the end of the input.
TEST_F(ConfigFiles, NulByteIsRefused) {
  const std::string text = std::string(R"({"d_model":8,"num_heads":2})") + '\0' + "garbage";
  const std::string p = file("nul.json", text);
  EXPECT_TRUE(ThrowsError([&] { load_config(p); }, ErrorCode::bad_file, p + ": not valid JSON: NUL byte at offset 27"));
  EXPECT_TRUE(ThrowsError([&] { load_any_config(p); }, ErrorCode::bad_file, "NUL byte at offset 27"));
  EXPECT_TRUE(ThrowsError([&] { config_from_json(text, "t"); }, ErrorCode::bad_file, "t: not valid JSON: NUL byte"));
  const std::string hf = hf_config() + '\0';
  EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json(hf, "hf"); }, ErrorCode::bad_file,
                          "NUL byte at offset " + std::to_string(hf.size() - 1)));
}

// Defect 3: a FIFO blocked forever, /dev/zero was read until memory ran out, a directory was "not valid JSON", and
// a file of any size was read whole. The order matters on a reader without the fix: the cases that cannot hang or
// exhaust memory come first, and the FIFO's ASSERT stops the test before /dev/zero would be read.
TEST_F(ConfigFiles, OnlyARegularFileOfAtMostOneMiBIsRead) {
  EXPECT_TRUE(ThrowsError([&] { load_config(path("missing.json")); }, ErrorCode::bad_file,
                          path("missing.json") + ": cannot open config file"));
  EXPECT_TRUE(
      ThrowsError([&] { load_config(dir_.string()); }, ErrorCode::bad_file, dir_.string() + ": not a regular file"));

  // Too large: refused before reading, naming the bound; exactly 1 MiB (valid JSON padded with spaces) loads.
  std::string text = R"({"d_model": 8, "num_heads": 2})";
  text.resize(size_t{1} << 20, ' ');
  EXPECT_EQ(load_config(file("one_mib.json", text)).d_model, 8);
  const std::string big = file("big.json", text + " ");
  EXPECT_TRUE(ThrowsError([&] { load_any_config(big); }, ErrorCode::bad_file,
                          big + ": 1048577 bytes, over the 1048576-byte (1 MiB) limit"));

  // A link to a regular file is read.
  fs::create_symlink(file("ok.json", R"({"d_model": 8, "num_heads": 2})"), path("link_to_ok.json"));
  EXPECT_EQ(load_config(path("link_to_ok.json")).num_heads, 2);

  // A FIFO. Without the fix the reader blocks opening it; a writer that opens and closes it then ends the wait (the
  // reader sees an empty file), so the test fails instead of hanging.
  const std::string fifo = path("fifo.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::atomic<bool> done{false};
  std::thread unblock([&] {
    while (!done) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // succeeds only while a reader has it open
      if (fd >= 0) {
        ::close(fd);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const auto fifo_refused =
      ThrowsError([&] { load_any_config(fifo); }, ErrorCode::bad_file, fifo + ": not a regular file");
  done = true;
  unblock.join();
  ASSERT_TRUE(fifo_refused);
  // So is a link to one.
  fs::create_symlink(fifo, path("link_to_fifo.json"));
  EXPECT_TRUE(ThrowsError([&] { load_config(path("link_to_fifo.json")); }, ErrorCode::bad_file,
                          "link_to_fifo.json: not a regular file"));

  EXPECT_TRUE(ThrowsError([&] { load_config("/dev/zero"); }, ErrorCode::bad_file, "/dev/zero: not a regular file"));
  EXPECT_TRUE(ThrowsError([&] { load_any_config("/dev/null"); }, ErrorCode::bad_file, "/dev/null: not a regular file"));
  // A socket is refused by its type too (opening one fails with ENXIO, which named no type): the path is looked up
  // before it is opened.
  const std::string sock = path("s.sock");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock.size() < sizeof addr.sun_path) {
    std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(s, 0);
    ASSERT_EQ(::bind(s, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_TRUE(ThrowsError([&] { load_config(sock); }, ErrorCode::bad_file, sock + ": not a regular file (a socket)"));
    ::close(s);
  }

  // Unreadable: still "cannot open config file" (root reads it anyway, so only checked for other users).
  if (::geteuid() != 0) {
    const std::string p = file("unreadable.json", R"({"d_model": 8, "num_heads": 2})");
    ASSERT_EQ(::chmod(p.c_str(), 0), 0);
    EXPECT_TRUE(ThrowsError([&] { load_config(p); }, ErrorCode::bad_file, p + ": cannot open config file"));
  }
}

// Defect 4: Hugging Face keys that describe a different attention were ignored and the model computed wrongly.
TEST_F(ConfigFiles, HuggingFaceKeysThatChangeTheAttentionAreRefused) {
  for (const char* extra : {R"("scale_attn_weights": false,)", R"("scale_attn_by_inverse_layer_idx": true,)",
                            R"("add_cross_attention": true,)"}) {
    const std::string key = std::string(extra).substr(1, std::string(extra).find('"', 1) - 1);
    const std::string p = file(key + ".json", hf_config(extra));
    EXPECT_TRUE(ThrowsError([&] { load_any_config(p); }, ErrorCode::bad_file, p + ": '" + key + "' is ")) << extra;
    EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json(hf_config(extra), "hf"); }, ErrorCode::bad_file, "gpt2attn"))
        << extra;
    for (const char* bad : {"0", "1", "\"true\"", "null"}) {
      EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json(hf_config("\"" + key + "\": " + bad + ","), "hf"); },
                              ErrorCode::bad_file, "hf: '" + key + "' must be true or false"))
          << key << " " << bad;
    }
  }
  // Their defaults, and reorder_and_upcast_attn (numerics only: fp32 scores under fp16 autocast), are fine.
  const Config c = hf_gpt2_config_from_json(hf_config(
      R"("scale_attn_weights": true, "scale_attn_by_inverse_layer_idx": false, "add_cross_attention": false,
         "reorder_and_upcast_attn": true,)"));
  EXPECT_EQ(c.d_model, 768);
  EXPECT_EQ(c.num_heads, 12);
}

// Defect 5: 18446744073709551615 was reported as "got -1" (wrapped to int64) and 0.9999999999 as "got 1.000000"
// (narrowed to float first); -1e-50 was narrowed to -0.0f and accepted.
TEST_F(ConfigFiles, OutOfRangeNumbersAreReportedAsWritten) {
  for (const char* n : {"18446744073709551615", "9223372036854775808"}) {
    const std::string p = file("big_int.json", std::string(R"({"num_heads": 2, "d_model": )") + n + "}");
    EXPECT_TRUE(ThrowsError([&] { load_config(p); }, ErrorCode::bad_file,
                            p + ": 'd_model' is out of range: " + std::string(n)));
    EXPECT_TRUE(ThrowsError(
        [&] { hf_gpt2_config_from_json(R"({"n_embd": 8, "n_head": 2, "n_positions": )" + std::string(n) + "}", "hf"); },
        ErrorCode::bad_file, "hf: 'n_positions' is out of range: " + std::string(n)));
  }
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "num_heads": 18446744073709551616})", "t"); },
                          ErrorCode::bad_file, "t: 'num_heads' is out of range"));
  // INT64_MAX fits, and is refused by the range check with its own value.
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 9223372036854775807, "num_heads": 2})", "t"); },
                          ErrorCode::bad_file, "got 9223372036854775807"));

  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": 0.9999999999})", "t"); },
                          ErrorCode::bad_file, "t: 'dropout' 0.9999999999 rounds to 1 as a float"));
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": 1.5})", "t"); },
                          ErrorCode::bad_file, "t: 'dropout' must be in [0, 1), got 1.5"));
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": -1e-50})", "t"); },
                          ErrorCode::bad_file, "got -1e-50"));
  EXPECT_TRUE(ThrowsError([&] { config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": 1e300})", "t"); },
                          ErrorCode::bad_file, "got 1e+300"));
  // The largest float below 1, and a double just below the rounding point to 1, still load.
  EXPECT_EQ(config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": 0.99999994})").dropout, 0.99999994f);
  EXPECT_LT(config_from_json(R"({"d_model": 8, "num_heads": 2, "dropout": 0.99999997})").dropout, 1.0f);
}

// A file with Hugging Face keys and ours loaded as Hugging Face's, our d_model/context_length silently dropped
// (or, without n_embd, as ours with an unknown-key error about n_head): the ambiguity is refused, naming a key of each.
TEST_F(ConfigFiles, HuggingFaceAndNativeKeysTogetherAreRefused) {
  const std::string both = file("both.json", hf_config(R"("d_model": 64, "context_length": 32,)"));
  EXPECT_TRUE(ThrowsError([&] { load_any_config(both); }, ErrorCode::bad_file,
                          both + ": holds both Hugging Face GPT-2 keys ('n_embd') and gpt2attn keys ('d_model')"));
  const std::string no_embd = file("no_embd.json", R"({"n_head": 2, "d_model": 8, "num_heads": 2})");
  EXPECT_TRUE(ThrowsError([&] { load_any_config(no_embd); }, ErrorCode::bad_file,
                          "('n_head') and gpt2attn keys ('d_model')"));
  const std::string ctx = file("ctx.json", R"({"d_model": 8, "num_heads": 2, "n_positions": 16})");
  EXPECT_TRUE(ThrowsError([&] { load_any_config(ctx); }, ErrorCode::bad_file,
                          "('n_positions') and gpt2attn keys ('d_model')"));
}

// config.json with a UTF-8 byte-order mark loaded (nlohmann skips one) while a safetensors header with one was
// refused; one rule for every JSON reader now, refused with the same words (test_safetensors.cpp checks the header).
TEST_F(ConfigFiles, ByteOrderMarkIsRefusedAsInSafetensors) {
  const std::string ours = file("bom.json", "\xEF\xBB\xBF" R"({"d_model": 8, "num_heads": 2})");
  const std::string hf = file("bom_hf.json", "\xEF\xBB\xBF" + hf_config());
  for (const std::string& p : {ours, hf}) {
    EXPECT_TRUE(ThrowsError([&] { load_any_config(p); }, ErrorCode::bad_file,
                            p + ": config is not valid JSON: it starts with a UTF-8 byte-order mark"));
  }
  EXPECT_TRUE(ThrowsError([&] { load_config(ours); }, ErrorCode::bad_file, "starts with a UTF-8 byte-order mark"));
  EXPECT_TRUE(ThrowsError([&] { hf_gpt2_config_from_json("\xEF\xBB\xBF" + hf_config(), "t"); }, ErrorCode::bad_file,
                          "t: config is not valid JSON: it starts with a UTF-8 byte-order mark"));
}

// What must keep loading: configs/*.json (each as its preset), every preset, a Hugging Face GPT-2 config.json.
TEST_F(ConfigFiles, ShippedConfigsPresetsAndHuggingFaceConfigsLoad) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(kSourceDir / "configs")) {
    if (e.path().extension() != ".json") continue;
    const std::string p = e.path().string();
    Config c, any;
    ASSERT_NO_THROW(c = load_config(p)) << p;
    ASSERT_NO_THROW(any = load_any_config(p)) << p;
    EXPECT_EQ(to_json(c), to_json(any)) << p;
    EXPECT_EQ(to_json(c), to_json(preset(e.path().stem().string()))) << p;
    ++n;
  }
  EXPECT_GE(n, 12);
  for (const std::string& name : preset_names()) EXPECT_NO_THROW(preset(name).validate()) << name;
  EXPECT_EQ(preset_names().size(), static_cast<size_t>(n));

  const std::string hf = file("config.json", hf_config());
  const Config c = load_any_config(hf);
  EXPECT_EQ(c.d_model, 768);
  EXPECT_EQ(c.num_heads, 12);
  EXPECT_EQ(c.context_length, 1024);
  EXPECT_TRUE(c.causal && c.qkv_bias && c.out_bias);
  const Config shipped = load_any_config((kSourceDir / "tests/fuzz/corpus/config/hf_gpt2_config.json").string());
  EXPECT_EQ(to_json(shipped), to_json(c));
}

}  // namespace
}  // namespace gpt2attn
