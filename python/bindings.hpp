// python/bindings.hpp: what the module's two source files share: module.cpp (the attention library's classes, the
// error classes, the array conventions) defines these helpers; model_bindings.cpp (the model library's GPT2) uses them.
// Nothing here is part of any public API.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/options.hpp"

namespace gpt2attn_py {

// Throws gpt2attn::Error(invalid_argument): gpt2attn.InvalidArgument in Python.
[[noreturn]] void invalid(const std::string& what);

// obj as a numpy array without copying: np.asarray (a CPU torch tensor gives a view of its memory; a CUDA one, or one
// recording a gradient, is refused naming `name`). Unlike py::array::ensure, a failure keeps the exception the object
// raised.
pybind11::array as_array(const pybind11::handle& obj, const char* name);

// Engine options by the module's names: compute "f32" or "bf16"; weights_dtype None (the compute type), the compute
// type's own name, "int8" or "int4"; isa "best" or an instruction set's name.
gpt2attn::EngineOptions engine_options(int threads, const std::string& isa, const std::string& compute,
                                       const std::optional<std::string>& weights_dtype);

// A K/V storage type by name: the library's list (kv_cache_dtypes), by its names, "int8" for i8 and numpy's
// "float32" and "bfloat16".
gpt2attn::DType kv_dtype_of(const std::string& s);

// model_bindings.cpp: GPT2Config, gpt2_preset, ModelKvCache and GPT2 into the module.
void bind_model(pybind11::module_& m);

}  // namespace gpt2attn_py
