// GPT2Config's checks and presets.
#include <gtest/gtest.h>

#include <limits>

#include "gpt2attn/error.hpp"
#include "gpt2attn/gpt2_checkpoint.hpp"

namespace gpt2attn {
namespace {

TEST(GPT2Config, PresetsAreValidAndMapToTheAttentionPresets) {
  for (const char* name : {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"}) {
    const GPT2Config c = gpt2_preset(name);
    EXPECT_NO_THROW(c.validate()) << name;
    const Config a = c.attention(), p = preset(name);
    EXPECT_EQ(a.d_model, p.d_model) << name;
    EXPECT_EQ(a.num_heads, p.num_heads) << name;
    EXPECT_EQ(a.context_length, p.context_length) << name;
    EXPECT_TRUE(a.causal && a.qkv_bias && a.out_bias) << name;
    EXPECT_EQ(c.inner(), 4 * c.n_embd) << name;
  }
  EXPECT_EQ(gpt2_preset("gpt2-xl").n_layer, 48);
  try {
    gpt2_preset("gpt2-huge");
    FAIL() << "an unknown preset was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("gpt2-medium"), std::string::npos) << e.what();
  }
}

TEST(GPT2Config, BadFieldsAreNamed) {
  struct Case {
    void (*set)(GPT2Config&);
    const char* field;
  };
  const Case cases[] = {
      {[](GPT2Config& c) { c.vocab_size = 0; }, "vocab_size"},
      {[](GPT2Config& c) { c.n_layer = -1; }, "n_layer"},
      {[](GPT2Config& c) { c.n_head = 5; }, "num_heads"},  // 768 is no multiple of 5: the attention config says so
      {[](GPT2Config& c) { c.n_inner = -3; }, "n_inner"},
      {[](GPT2Config& c) { c.layer_norm_epsilon = 0.0f; }, "layer_norm_epsilon"},
      {[](GPT2Config& c) { c.layer_norm_epsilon = std::numeric_limits<float>::quiet_NaN(); }, "layer_norm_epsilon"},
      {[](GPT2Config& c) { c.vocab_size = int64_t{1} << 31; }, "vocab_size"},
  };
  for (const Case& k : cases) {
    GPT2Config c;
    k.set(c);
    try {
      c.validate();
      ADD_FAILURE() << k.field << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(k.field), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace gpt2attn
