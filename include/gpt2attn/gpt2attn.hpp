// gpt2attn/gpt2attn.hpp: the whole C++ API in one include.
#pragma once

#include "gpt2attn/attention.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/ops.hpp"
#include "gpt2attn/reference.hpp"
#include "gpt2attn/safetensors.hpp"
#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"
#include "gpt2attn/tolerance.hpp"
