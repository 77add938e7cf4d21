// python/module.cpp: gpt2attn._gpt2attn, the C++ API for Python (pybind11). The package python/gpt2attn/ wraps it.
//
// Arrays: numpy arrays, or anything np.asarray() views without copying (a CPU torch tensor). They are read where
// they lie: float32 only (float64 and the rest are refused with a message, never converted behind the caller's
// back); CausalSelfAttention's calls take C-contiguous arrays, as the C++ API does; MultiheadAttention's take
// strided views, passed on as TensorView strides. `out=` must be a writeable C-contiguous float32 array of the
// result's shape, and is written in place; without it a new array is returned. Compute calls release the GIL,
// so Python threads with their own Workspace run them in parallel.
//
// Errors: gpt2attn::Error becomes gpt2attn.InvalidArgument (a ValueError), BadFile (an OSError), OutOfMemory (a
// MemoryError) or InternalError (a RuntimeError), all subclasses of gpt2attn.Error, with the library's message.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "gpt2attn/gpt2attn.h"
#include "gpt2attn/gpt2attn.hpp"

namespace py = pybind11;
namespace ga = gpt2attn;
using namespace gpt2attn_py;  // the helpers model_bindings.cpp shares (bindings.hpp)

[[noreturn]] void gpt2attn_py::invalid(const std::string& what) {
  throw ga::Error(ga::ErrorCode::invalid_argument, what);
}

namespace {

// The exception classes, created once at import (create_errors).
PyObject* g_error = nullptr;
PyObject* g_errors[5] = {};  // by ErrorCode; [0] unused

PyObject* new_error_class(py::module_& m, const char* name, PyObject* base2, const char* doc) {
  py::tuple bases = py::make_tuple(py::handle(g_error), py::handle(base2));
  PyObject* cls = PyErr_NewExceptionWithDoc((std::string("gpt2attn.") + name).c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

void create_errors(py::module_& m) {
  g_error = PyErr_NewExceptionWithDoc("gpt2attn.Error", "Any error gpt2attn reports; its text names the problem.",
                                      PyExc_Exception, nullptr);
  if (g_error == nullptr) throw py::error_already_set();
  m.add_object("Error", py::handle(g_error));
  g_errors[static_cast<int>(ga::ErrorCode::invalid_argument)] = new_error_class(
      m, "InvalidArgument", PyExc_ValueError, "A shape, size, option, id or value the caller passed is wrong.");
  g_errors[static_cast<int>(ga::ErrorCode::bad_file)] =
      new_error_class(m, "BadFile", PyExc_OSError, "A weights or config file is missing, truncated or corrupt.");
  g_errors[static_cast<int>(ga::ErrorCode::out_of_memory)] = new_error_class(
      m, "OutOfMemory", PyExc_MemoryError, "An allocation failed or the KV pool is exhausted; nothing was written.");
  g_errors[static_cast<int>(ga::ErrorCode::internal)] =
      new_error_class(m, "InternalError", PyExc_RuntimeError, "A bug, or a failure inside a dependency.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ga::Error& e) {
      const int code = static_cast<int>(e.code());
      PyErr_SetString(code >= 1 && code <= 4 ? g_errors[code] : g_error, e.what());
    }
  });
}

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool is_torch(const py::handle& obj) {
  return py::str(py::type::handle_of(obj).attr("__module__")).cast<std::string>().rfind("torch", 0) == 0;
}

bool is_torch_bf16(const py::handle& obj) {
  return is_torch(obj) && py::str(obj.attr("dtype")).cast<std::string>() == "torch.bfloat16";
}

// A torch tensor as the library may read it: on the CPU, and not one whose gradient is being recorded (the library
// computes none, and reading it would silently cut the graph). With grad mode off, a tensor that requires grad (a
// parameter) is read through .detach(), a view of the same memory.
py::object readable_tensor(const py::handle& obj, const char* name) {
  const std::string device = py::str(obj.attr("device").attr("type"));
  if (device != "cpu") {
    invalid(std::string(name) + ": a " + device + " tensor; gpt2attn computes on the CPU (pass x.cpu())");
  }
  if (!obj.attr("requires_grad").cast<bool>()) return py::reinterpret_borrow<py::object>(obj);
  if (py::module_::import("torch").attr("is_grad_enabled")().cast<bool>()) {
    invalid(std::string(name) + ": the tensor requires grad and grad mode is on; gpt2attn computes no gradients: "
            "call it under torch.no_grad() or torch.inference_mode(), or pass x.detach()");
  }
  return obj.attr("detach")();
}

}  // namespace

py::array gpt2attn_py::as_array(const py::handle& obj, const char* name) {
  py::object src = py::reinterpret_borrow<py::object>(obj);
  if (is_torch(obj)) {
    src = readable_tensor(obj, name);
    if (is_torch_bf16(src)) {  // numpy has no bfloat16
      invalid(std::string(name) + ": a torch.bfloat16 tensor, where this call takes float32 (pass x.float(); "
              "MultiHeadAttention.forward reads bf16 tensors in place)");
    }
  }
  py::array a = py::reinterpret_steal<py::array>(py::detail::npy_api::get().PyArray_FromAny_(
      src.ptr(), nullptr, 0, 0, py::detail::npy_api::NPY_ARRAY_ENSUREARRAY_, nullptr));
  if (!a) throw py::error_already_set();
  return a;
}

namespace {

// What a call returns: the caller's out= object itself when given, else the new array, as a torch tensor sharing its
// memory when the input was a torch tensor (tensors in, tensors out).
py::object result(const py::array& y, const py::object& out, const py::handle& input) {
  if (!out.is_none()) return out;
  if (is_torch(input)) return py::module_::import("torch").attr("from_numpy")(y);
  return y;
}

// obj as a float32 numpy array without copying.
py::array as_f32(const py::handle& obj, const char* name) {
  py::array a = as_array(obj, name);
  if (!a.dtype().equal(py::dtype::of<float>())) {  // equal, not identical: a dtype from pickle is another object
    invalid(std::string(name) + ": dtype " + std::string(py::str(a.dtype())) +
            ", expected float32 (gpt2attn computes in float32 and converts nothing itself: pass x.astype(np.float32))");
  }
  if (reinterpret_cast<uintptr_t>(a.data()) % alignof(float) != 0) {  // np.frombuffer(b, np.float32, offset=1)
    invalid(std::string(name) + ": the data is not aligned to float32's 4 bytes: pass a copy (x.copy())");
  }
  return a;
}

// A C-contiguous float32 array of the given shape (for the calls that take plain pointers).
py::array contiguous_f32(const py::handle& obj, const char* name, const std::vector<int64_t>& shape) {
  py::array a = as_f32(obj, name);
  if (!(a.flags() & py::array::c_style)) {
    invalid(std::string(name) + ": not C-contiguous (shape " + shape_of(a) +
            "); this call reads a contiguous array: pass np.ascontiguousarray(" + name + ")");
  }
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || a.shape(static_cast<py::ssize_t>(i)) == shape[i];
  if (!ok) {
    std::string want = "(";
    for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? "*" : std::to_string(shape[i]));
    invalid(std::string(name) + ": shape " + shape_of(a) + ", expected " + want + ")");
  }
  return a;
}

// The caller's out= (checked: writeable, C-contiguous float32 of exactly `shape`), or a new array.
py::array output(const py::object& out, const std::vector<int64_t>& shape) {
  if (out.is_none()) return py::array_t<float>(std::vector<py::ssize_t>(shape.begin(), shape.end()));
  py::array a = contiguous_f32(out, "out", shape);
  if (!a.writeable()) invalid("out: the array is read-only");
  return a;
}

// An array whose elements are `dtype` as a strided TensorView (strides in elements; a byte stride that is not a
// whole number of elements is refused). Rank 1 to 4.
ga::TensorView view_of(const py::array& a, const char* name, ga::DType dtype = ga::DType::f32) {
  if (a.ndim() < 1 || a.ndim() > 4) {
    invalid(std::string(name) + ": rank " + std::to_string(a.ndim()) + ", expected 1 to 4");
  }
  const auto item = static_cast<py::ssize_t>(ga::size_of(dtype));
  if (reinterpret_cast<uintptr_t>(a.data()) % static_cast<uintptr_t>(item) != 0) {
    invalid(std::string(name) + ": the data is not aligned to its " + std::to_string(item) +
            "-byte elements: pass a copy");
  }
  ga::TensorView v;
  v.data = a.data();
  v.dtype = dtype;
  v.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = a.shape(i);
    if (a.strides(i) % item != 0) {
      invalid(std::string(name) + ": a byte stride of " + std::to_string(a.strides(i)) + " is not whole elements");
    }
    v.strides[i] = a.strides(i) / item;
  }
  return v;
}

// A torch bfloat16 tensor (numpy has no bf16) as a strided bf16 TensorView of its memory; torch's strides are
// already in elements.
ga::TensorView bf16_view(const py::object& t, const char* name) {
  const auto shape = t.attr("shape").cast<std::vector<int64_t>>();
  const auto strides = t.attr("stride")().cast<std::vector<int64_t>>();
  if (shape.empty() || shape.size() > 4) {
    invalid(std::string(name) + ": rank " + std::to_string(shape.size()) + ", expected 1 to 4");
  }
  ga::TensorView v;
  v.data = reinterpret_cast<const void*>(t.attr("data_ptr")().cast<uintptr_t>());
  v.dtype = ga::DType::bf16;
  v.rank = static_cast<int>(shape.size());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[static_cast<size_t>(i)] = shape[static_cast<size_t>(i)];
    v.strides[static_cast<size_t>(i)] = strides[static_cast<size_t>(i)];
  }
  return v;
}

// A cached K or V row (read_key / read_value) as a new float32 (D,) array.
py::array_t<float> cached_row(const ga::KvCache& c,
                              void (ga::KvCache::*read)(ga::SequenceId, int64_t, int64_t, float*) const,
                              ga::SequenceId seq, int64_t h, int64_t t) {
  py::array_t<float> a(c.config().head_dim());
  (c.*read)(seq, h, t, a.mutable_data());
  return a;
}

}  // namespace

ga::EngineOptions gpt2attn_py::engine_options(int threads, const std::string& isa, const std::string& compute,
                                 const std::optional<std::string>& weights_dtype) {
  ga::EngineOptions o;
  o.threads = threads;
  o.isa = ga::isa_from_string(isa);
  if (compute != "f32" && compute != "bf16") invalid("compute '" + compute + "' (supported: f32, bf16)");
  o.compute = ga::dtype_from_string(compute);
  if (weights_dtype && *weights_dtype != compute) {
    if (*weights_dtype != "int8" && *weights_dtype != "int4") {
      invalid("weights_dtype '" + *weights_dtype + "' (supported: None or '" + compute +
              "' for the compute type, 'int8', 'int4')");
    }
    o.weights = ga::weight_format_from_string(*weights_dtype);
  }
  return o;
}

ga::DType gpt2attn_py::kv_dtype_of(const std::string& s) {
  const std::string name = s == "float32" ? "f32" : s == "bfloat16" ? "bf16" : s == "int8" ? "i8" : s;
  std::string supported;
  for (ga::DType t : ga::kv_cache_dtypes()) {
    if (name == ga::to_string(t)) return t;
    supported += (supported.empty() ? "" : ", ") + std::string(t == ga::DType::i8 ? "int8" : ga::to_string(t));
  }
  invalid("KvCache dtype '" + s + "' (supported: " + supported + ")");
}

namespace {

std::vector<float> vec_of(const py::object& obj, const char* name) {
  if (obj.is_none()) return {};
  py::array a = contiguous_f32(obj, name, {-1});
  const float* p = static_cast<const float*>(a.data());
  return std::vector<float>(p, p + a.size());
}

std::vector<float> matrix_of(const py::object& obj, const char* name, std::array<int64_t, 2>& shape) {
  py::array a = as_f32(obj, name);
  if (a.ndim() != 2 || !(a.flags() & py::array::c_style)) {
    invalid(std::string(name) + ": expected a C-contiguous 2-D float32 array, got shape " + shape_of(a));
  }
  shape = {a.shape(0), a.shape(1)};
  const float* p = static_cast<const float*>(a.data());
  return std::vector<float>(p, p + a.size());
}

// Weights as Python holds them: the library's flat vectors, and the (out, in) shapes the matrices came in (none for
// Weights.random and load_safetensors, whose shapes the config fixes). The shapes are checked against the config
// where a layer or the reference is built: ga::Weights checks sizes only, and a (8, 16) matrix passed where (16, 8)
// belongs (torch's Linear against a Conv1D's transposed layout) has the same size.
struct PyWeights {
  ga::Weights w;
  std::optional<std::array<std::array<int64_t, 2>, 4>> shapes;  // w_q, w_k, w_v, w_o

  const ga::Weights& for_config(const ga::Config& c) const {
    if (shapes) {
      const int64_t E = c.d_model, KW = c.kv_width();
      const std::array<std::array<int64_t, 2>, 4> want = {
          {{E, c.query_width()}, {KW, c.key_width()}, {KW, c.value_width()}, {E, E}}};
      const char* const names[4] = {"w_q", "w_k", "w_v", "w_o"};
      for (int i = 0; i < 4; ++i) {
        const auto& got = (*shapes)[static_cast<size_t>(i)];
        const auto& exp = want[static_cast<size_t>(i)];
        if (got != exp) {
          invalid(std::string("weights: ") + names[i] + " has shape (" + std::to_string(got[0]) + ", " +
                  std::to_string(got[1]) + "), expected (out, in) = (" + std::to_string(exp[0]) + ", " +
                  std::to_string(exp[1]) + ") for this config");
        }
      }
    }
    return w;
  }
};

ga::RunOptions run_options(int threads, bool training = false, uint64_t seed = 0) {
  ga::RunOptions r;
  r.threads = threads;
  r.training = training;
  r.dropout_seed = seed;
  return r;
}

// MultiheadAttention.forward's inputs as views of the caller's arrays (kept alive by `keep`).
ga::AttentionInputs attention_inputs(int64_t num_heads, const py::object& query, const py::object& key,
                                     const py::object& value, const py::object& attn_mask,
                                     const std::optional<std::string>& mask_kind, const py::object& key_padding,
                                     std::vector<py::object>& keep) {
  ga::AttentionInputs in;
  // float32 arrays and tensors as numpy views; torch bfloat16 tensors as bf16 views of their memory.
  auto input_view = [&](const py::object& x, const char* name) {
    if (is_torch_bf16(x)) {
      keep.push_back(readable_tensor(x, name));
      return bf16_view(keep.back(), name);
    }
    py::array a = as_f32(x, name);
    keep.push_back(a);
    return view_of(a, name);
  };
  in.query = input_view(query, "query");
  if (key.is_none() != value.is_none()) invalid("key and value: give both or neither (neither: self-attention)");
  if (!key.is_none()) {
    in.key = input_view(key, "key");
    in.value = input_view(value, "value");
  }
  // Masks: float32 as given; bool / uint8 as u8.
  auto mask_view = [&](const py::object& m, const char* name) {
    py::array a = as_array(m, name);
    keep.push_back(a);
    if (a.dtype().equal(py::dtype::of<float>())) return view_of(a, name);
    if (a.dtype().equal(py::dtype::of<bool>()) || a.dtype().equal(py::dtype::of<uint8_t>())) {
      return view_of(a, name, ga::DType::u8);
    }
    invalid(std::string(name) + ": dtype " + std::string(py::str(a.dtype())) + ", expected bool, uint8 or float32");
  };
  if (!attn_mask.is_none()) {
    in.attn_mask = mask_view(attn_mask, "attn_mask");
    // numpy's broadcasting over size-1 B or H axes, and torch's (B * H, T, Tk)
    if (in.query.rank == 3) in.attn_mask = ga::torch_mask_view(in.attn_mask, in.query.shape[0], num_heads);
    in.mask_kind = mask_kind ? ga::mask_kind_from_string(*mask_kind) : ga::torch_mask_kind(in.attn_mask.dtype);
  }
  if (!key_padding.is_none()) in.key_padding = mask_view(key_padding, "key_padding");
  if (in.query.rank != 3) invalid("query: shape " + in.query.shape_str() + ", expected (B, T, d_in)");
  return in;
}

}  // namespace

// A layer of type L built from one attention layer of a safetensors file, its tensors read as stored (a BF16 file
// reaches a bf16 layer without an f32 copy); `config` gives num_heads and context_length, the file the sizes.
template <class L>
L layer_from_safetensors(const std::string& path, const ga::Config& config, const std::string& prefix, int threads,
                         const std::string& isa, const std::string& compute,
                         const std::optional<std::string>& weights_dtype) {
  const ga::StoredLayer stored = ga::open_safetensors_layer(path, prefix);
  return L(ga::apply_loaded_shapes(config, stored), stored.weights,
           engine_options(threads, isa, compute, weights_dtype));
}

// A layer of type L built from a file of save_quantized's (gpt2attn.save_quantized, `gpt2attn quantize`): the codes
// as saved, in the file's format; `config` gives num_heads and context_length, the file the sizes.
template <class L>
L layer_from_quantized(const std::string& path, const ga::Config& config, int threads, const std::string& isa,
                       const std::string& compute, const std::optional<std::string>& weights_dtype) {
  const std::optional<ga::QuantizedLayerShapes> shapes = ga::quantized_layer_shapes(path);
  if (!shapes) {
    ga::fail(ga::ErrorCode::bad_file, path + ": no 'gpt2attn.weights' metadata: not a file of save_quantized's (a "
                                             "float checkpoint loads with from_safetensors)");
  }
  const ga::Config c = ga::apply_loaded_shapes(config, *shapes);
  const ga::QuantizedWeights q = ga::load_quantized(path, c);
  return L(c, q, engine_options(threads, isa, compute, weights_dtype));
}

PYBIND11_MODULE(_gpt2attn, m) {
  m.doc() = "gpt2attn: GPT-2-style multi-head attention on CPUs (the C++ library, zero-copy over float32 arrays)";
  create_errors(m);
  bind_model(m);  // model_bindings.cpp: GPT2, GPT2Config, ModelKvCache

  m.def("version", [] { return std::string(gpt2attn_version()); }, "The library's MAJOR.MINOR.PATCH.");
  m.def("best_isa", [] { return std::string(ga::to_string(ga::best_supported_isa())); },
        "The strongest kernel instruction set this CPU runs: avx512_bf16, avx512, avx2 or scalar.");
  m.def("compiled_isas", [] {
    std::vector<std::string> v;
    for (ga::Isa i : ga::compiled_isas()) v.emplace_back(ga::to_string(i));
    return v;
  });
  m.def("preset_names", &ga::preset_names);
  m.def("load_config", &ga::load_any_config, py::arg("path"),
        "The Config of a file: a Hugging Face GPT-2 config.json (causal, with biases) or one of configs/*.json.");
  m.def("preset", &ga::preset, py::arg("name"), "The Config of a GPT-2/GPT-3 preset, e.g. 'gpt2-small'.");

  // gpt2attn/ops.hpp: x of any rank >= 1, C-contiguous float32, its last dimension the row.
  m.def(
      "layer_norm",
      [](const py::object& x, const py::object& gamma, const py::object& beta, double eps, int threads,
         const std::string& isa, const py::object& out) {
        const py::array xa = as_f32(x, "x");
        if (xa.ndim() < 1 || xa.shape(xa.ndim() - 1) < 1) invalid("layer_norm: x needs a last dimension of 1 or more");
        std::vector<int64_t> shape(xa.shape(), xa.shape() + xa.ndim());
        const int64_t E = shape.back(), M = E ? static_cast<int64_t>(xa.size()) / E : 0;
        const py::array xc = contiguous_f32(x, "x", shape);
        const py::array g = contiguous_f32(gamma, "gamma", {E}), b = contiguous_f32(beta, "beta", {E});
        py::array y = output(out, shape);
        const ga::RowOpOptions o{threads, ga::isa_from_string(isa)};
        {
          py::gil_scoped_release nogil;
          ga::layer_norm(static_cast<const float*>(xc.data()), M, E, static_cast<const float*>(g.data()),
                         static_cast<const float*>(b.data()), static_cast<float>(eps),
                         static_cast<float*>(y.mutable_data()), o);
        }
        return result(y, out, x);
      },
      py::arg("x"), py::arg("gamma"), py::arg("beta"), py::arg("eps") = 1e-5, py::arg("threads") = 0,
      py::arg("isa") = "best", py::arg("out") = py::none(),
      "LayerNorm over x's last dimension (torch.nn.LayerNorm's), float32; gamma and beta of that length.");
  m.def(
      "gelu_tanh",
      [](const py::object& x, int threads, const std::string& isa, const py::object& out) {
        const py::array xa = as_f32(x, "x");
        std::vector<int64_t> shape(xa.shape(), xa.shape() + xa.ndim());
        const py::array xc = contiguous_f32(x, "x", shape);
        py::array y = output(out, shape);
        const ga::RowOpOptions o{threads, ga::isa_from_string(isa)};
        {
          py::gil_scoped_release nogil;
          if (y.data() != xc.data()) {
            std::copy_n(static_cast<const float*>(xc.data()), xc.size(), static_cast<float*>(y.mutable_data()));
          }
          ga::gelu_tanh(static_cast<float*>(y.mutable_data()), static_cast<int64_t>(y.size()), o);
        }
        return result(y, out, x);
      },
      py::arg("x"), py::arg("threads") = 0, py::arg("isa") = "best", py::arg("out") = py::none(),
      "GELU in GPT-2's tanh approximation (torch's gelu(approximate='tanh')), float32; out=x works in place.");

  py::class_<ga::Config>(m, "Config", "A layer's sizes and options (gpt2attn/config.hpp); 0 means the default.")
      .def(py::init([](int64_t d_model, int64_t num_heads, int64_t num_kv_heads, int64_t d_in, int64_t kdim,
                       int64_t vdim, int64_t context_length, bool qkv_bias, bool out_bias, bool causal,
                       float dropout) {
             ga::Config c;
             c.d_model = d_model, c.num_heads = num_heads, c.num_kv_heads = num_kv_heads, c.d_in = d_in;
             c.kdim = kdim, c.vdim = vdim, c.context_length = context_length, c.qkv_bias = qkv_bias;
             c.out_bias = out_bias, c.causal = causal, c.dropout = dropout;
             return c;
           }),
           py::arg("d_model"), py::arg("num_heads"), py::arg("num_kv_heads") = 0, py::arg("d_in") = 0,
           py::arg("kdim") = 0, py::arg("vdim") = 0, py::arg("context_length") = 1024, py::arg("qkv_bias") = true,
           py::arg("out_bias") = true, py::arg("causal") = false, py::arg("dropout") = 0.0f)
      .def_readwrite("d_model", &ga::Config::d_model)
      .def_readwrite("num_heads", &ga::Config::num_heads)
      .def_readwrite("num_kv_heads", &ga::Config::num_kv_heads)
      .def_readwrite("d_in", &ga::Config::d_in)
      .def_readwrite("kdim", &ga::Config::kdim)
      .def_readwrite("vdim", &ga::Config::vdim)
      .def_readwrite("context_length", &ga::Config::context_length)
      .def_readwrite("qkv_bias", &ga::Config::qkv_bias)
      .def_readwrite("out_bias", &ga::Config::out_bias)
      .def_readwrite("causal", &ga::Config::causal)
      .def_readwrite("dropout", &ga::Config::dropout)
      .def_property_readonly("head_dim", &ga::Config::head_dim)
      .def_property_readonly("kv_heads", &ga::Config::kv_heads)
      .def("validate", &ga::Config::validate)
      .def("__repr__", [](const ga::Config& c) { return "gpt2attn.Config(" + ga::to_json(c) + ")"; });

  py::class_<PyWeights>(m, "Weights",
                        "Projection weights in torch's layout: w (out, in) and b (out); copied in. The shapes are "
                        "checked against the config where a layer is built.")
      .def(py::init([](const py::object& w_q, const py::object& w_k, const py::object& w_v, const py::object& w_o,
                       const py::object& b_q, const py::object& b_k, const py::object& b_v, const py::object& b_o) {
             PyWeights p;
             ga::Weights& w = p.w;
             std::array<std::array<int64_t, 2>, 4> shapes{};
             w.w_q = matrix_of(w_q, "w_q", shapes[0]), w.w_k = matrix_of(w_k, "w_k", shapes[1]);
             w.w_v = matrix_of(w_v, "w_v", shapes[2]), w.w_o = matrix_of(w_o, "w_o", shapes[3]);
             w.b_q = vec_of(b_q, "b_q"), w.b_k = vec_of(b_k, "b_k"), w.b_v = vec_of(b_v, "b_v");
             w.b_o = vec_of(b_o, "b_o");
             p.shapes = shapes;
             return p;
           }),
           py::arg("w_q"), py::arg("w_k"), py::arg("w_v"), py::arg("w_o"), py::arg("b_q") = py::none(),
           py::arg("b_k") = py::none(), py::arg("b_v") = py::none(), py::arg("b_o") = py::none())
      .def_static(
          "random", [](const ga::Config& c, uint64_t seed) { return PyWeights{ga::Weights::random(c, seed), {}}; },
          py::arg("config"), py::arg("seed") = 0,
          "Uniform +-1/sqrt(fan_in) weights (torch's default init), reproducible from the seed.")
      .def("validate", [](const PyWeights& p, const ga::Config& c) { p.for_config(c).validate(c); });

  m.def(
      "load_safetensors", [](const std::string& path, const std::string& prefix, ga::Config config) {
        const ga::LoadedLayer l = ga::load_safetensors_layer(path, prefix);
        return py::make_tuple(ga::apply_loaded_shapes(config, l), PyWeights{l.weights, {}});
      },
      py::arg("path"), py::arg("prefix") = "", py::arg("config"),
      "(config, weights) of one layer of a safetensors file (torch or Hugging Face GPT-2 names after prefix); "
      "config gives num_heads and context_length, the file the sizes.");

  m.def(
      "save_quantized",
      // The Config by value: another Python thread may change the caller's while this one runs without the GIL.
      [](const std::string& path, const ga::Config c, const PyWeights& w, const std::string& weights_dtype) {
        if (weights_dtype != "int8" && weights_dtype != "int4") {
          invalid("weights_dtype '" + weights_dtype + "' (supported: 'int8', 'int4')");
        }
        const ga::Weights& fw = w.for_config(c);  // w, an argument, outlives the call
        fw.validate(c);
        const ga::WeightFormat f = ga::weight_format_from_string(weights_dtype);
        py::gil_scoped_release nogil;
        ga::save_quantized(path, c, ga::QuantizedWeights::quantize(fw.view(c), f));
      },
      py::arg("path"), py::arg("config"), py::arg("weights"), py::arg("weights_dtype"),
      "Quantizes weights (each projection row: 'int8' one scale a row, 'int4' one per 32 inputs) and writes the codes, "
      "scales and biases to a safetensors file, atomically; CausalSelfAttention.from_quantized and "
      "MultiHeadAttention.from_quantized (and `gpt2attn forward --weights`) build layers from it that compute bit for "
      "bit what weights_dtype= quantizing the same weights computes.");

  py::class_<ga::Workspace>(m, "Workspace", "Scratch memory for one calling thread at a time.")
      .def(py::init<>())
      .def_property_readonly("bytes", &ga::Workspace::bytes);

  py::class_<ga::KvCache>(m, "KvCache", "A paged K/V pool and the sequences in it (gpt2attn/kv_cache.hpp).")
      .def(py::init([](const ga::Config& config, int64_t block_tokens, int64_t capacity_tokens,
                       size_t capacity_bytes, const std::string& dtype) {
             ga::KvCacheOptions o;
             o.block_tokens = block_tokens, o.capacity_tokens = capacity_tokens, o.capacity_bytes = capacity_bytes;
             o.dtype = kv_dtype_of(dtype);
             return ga::KvCache(config, o);
           }),
           py::arg("config"), py::arg("block_tokens") = 0, py::arg("capacity_tokens") = 0,
           py::arg("capacity_bytes") = 0, py::arg("dtype") = "f32")
      .def("create", &ga::KvCache::create)
      .def(
          "fork",
          [](ga::KvCache& c, ga::SequenceId parent, std::optional<int64_t> prefix_tokens) {
            return prefix_tokens ? c.fork(parent, *prefix_tokens) : c.fork(parent);
          },
          py::arg("parent"), py::arg("prefix_tokens") = py::none(),
          "A new sequence sharing the parent's tokens, or its first prefix_tokens of them.")
      .def("truncate", &ga::KvCache::truncate, py::arg("seq"), py::arg("new_length"),
           "Drops the sequence's tokens past new_length (rejected drafts); blocks nobody else holds are freed.")
      .def("release", &ga::KvCache::release, py::arg("seq"))
      .def("__contains__", &ga::KvCache::contains)
      .def("length", &ga::KvCache::length, py::arg("seq"))
      .def("blocks_needed", &ga::KvCache::blocks_needed, py::arg("seq"), py::arg("tokens"))
      .def_property_readonly("block_tokens", &ga::KvCache::block_tokens)
      .def_property_readonly("total_blocks", &ga::KvCache::total_blocks)
      .def_property_readonly("free_blocks", &ga::KvCache::free_blocks)
      .def_property_readonly("num_sequences", &ga::KvCache::num_sequences)
      .def_property_readonly("block_bytes", &ga::KvCache::block_bytes)
      .def_property_readonly("capacity_bytes", &ga::KvCache::capacity_bytes)
      .def_property_readonly("dtype", [](const ga::KvCache& c) { return std::string(ga::to_string(c.dtype())); })
      .def(
          "read_key", [](const ga::KvCache& c, ga::SequenceId seq, int64_t h, int64_t t) {
            return cached_row(c, &ga::KvCache::read_key, seq, h, t);
          },
          py::arg("seq"), py::arg("head"), py::arg("t"), "Cached key of K/V head `head`, token t, as float32 (D,).")
      .def(
          "read_value", [](const ga::KvCache& c, ga::SequenceId seq, int64_t h, int64_t t) {
            return cached_row(c, &ga::KvCache::read_value, seq, h, t);
          },
          py::arg("seq"), py::arg("head"), py::arg("t"), "Cached value of K/V head `head`, token t, as float32 (D,).");

  py::class_<ga::MultiHeadAttention>(m, "MultiHeadAttention",
                                     "torch.nn.MultiheadAttention's computation (gpt2attn/attention.hpp).")
      .def(py::init([](const ga::Config& c, const PyWeights& w, int threads, const std::string& isa,
                       const std::string& compute, const std::optional<std::string>& weights_dtype) {
             return ga::MultiHeadAttention(c, w.for_config(c), engine_options(threads, isa, compute, weights_dtype));
           }),
           py::arg("config"), py::arg("weights"), py::arg("threads") = 0, py::arg("isa") = "best",
           py::arg("compute") = "f32", py::arg("weights_dtype") = py::none(),
           "compute: 'f32' or 'bf16' (bf16 weights, projections and attention core with f32 accumulation; "
           "inputs and outputs stay float32 arrays). weights_dtype: None (the compute type), 'int8' (one scale per "
           "output row) or 'int4' (one per row and 32 inputs), quantized once here.")
      .def_static("from_safetensors", &layer_from_safetensors<ga::MultiHeadAttention>, py::arg("path"), py::arg("config"),
                  py::arg("prefix") = "", py::arg("threads") = 0, py::arg("isa") = "best", py::arg("compute") = "f32",
                  py::arg("weights_dtype") = py::none(),
                  "The layer of a safetensors file (torch or Hugging Face GPT-2 names after prefix), its tensors read "
                  "as stored: F32, F16 or BF16, converted once into the layer's compute type. config gives num_heads "
                  "and context_length, the file the sizes.")
      .def_static("from_quantized", &layer_from_quantized<ga::MultiHeadAttention>, py::arg("path"), py::arg("config"),
                  py::arg("threads") = 0, py::arg("isa") = "best", py::arg("compute") = "f32",
                  py::arg("weights_dtype") = py::none(),
                  "The layer of a file save_quantized (or `gpt2attn quantize`) wrote: its int8 or int4 codes as "
                  "saved. config gives num_heads and context_length, the file the sizes and the format; "
                  "weights_dtype: None (the file's) or the file's format.")
      .def(
          "forward",
          [](ga::MultiHeadAttention& self, const py::object& query, const py::object& key, const py::object& value,
             const py::object& attn_mask, const std::optional<std::string>& mask_kind, const py::object& key_padding,
             const py::object& out, int threads, bool training, uint64_t dropout_seed, ga::Workspace* ws) {
            std::vector<py::object> keep;
            const ga::AttentionInputs in =
                attention_inputs(self.config().num_heads, query, key, value, attn_mask, mask_kind, key_padding, keep);
            const std::vector<int64_t> shape = {in.query.shape[0], in.query.shape[1], self.config().d_model};
            if (is_torch_bf16(out)) {  // a bf16 layer writes bf16 from its output GEMM
              const ga::TensorView o = bf16_view(readable_tensor(out, "out"), "out");
              if (o.rank != 3 || o.shape[0] != shape[0] || o.shape[1] != shape[1] || o.shape[2] != shape[2] ||
                  o.strides[2] != 1 || o.strides[1] != shape[2] || o.strides[0] != shape[1] * shape[2]) {
                invalid("out: shape " + o.shape_str() + " or its strides are not a contiguous (" +
                        std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " + std::to_string(shape[2]) +
                        ")");
              }
              void* dst = const_cast<void*>(o.data);
              {
                py::gil_scoped_release nogil;
                self.forward(in, dst, ga::DType::bf16, run_options(threads, training, dropout_seed), ws);
              }
              return out;
            }
            py::array y = output(out, shape);
            float* dst = static_cast<float*>(y.mutable_data());
            {
              py::gil_scoped_release nogil;
              self.forward(in, dst, run_options(threads, training, dropout_seed), ws);
            }
            return result(y, out, query);
          },
          py::arg("query"), py::arg("key") = py::none(), py::arg("value") = py::none(),
          py::arg("attn_mask") = py::none(), py::arg("mask_kind") = py::none(), py::arg("key_padding") = py::none(),
          py::arg("out") = py::none(), py::arg("threads") = 0, py::arg("training") = false,
          py::arg("dropout_seed") = 0, py::arg("workspace") = nullptr,
          "out (B, T, E) = attention of query (B, T, d_in) over key/value (B, Tk, kdim/vdim; None: self-attention). "
          "Strided float32 views are read in place. mask_kind: None (torch's reading: bool blocks, float adds), "
          "keep (nonzero attends), block (nonzero does not: "
          "torch's bool mask) or additive (torch's float mask).")
      .def_property_readonly("config", [](const ga::MultiHeadAttention& s) { return s.config(); })  // a copy, as below
      .def_property_readonly("isa", [](const ga::MultiHeadAttention& s) { return std::string(ga::to_string(s.isa())); })
      .def_property_readonly("implementation", &ga::MultiHeadAttention::implementation)
      .def_property_readonly("default_threads", &ga::MultiHeadAttention::default_threads);

  py::class_<ga::CausalSelfAttention>(m, "CausalSelfAttention",
                                      "GPT-2's attention block: fused QKV, causal, with KV-cache serving.")
      .def(py::init([](const ga::Config& c, const PyWeights& w, int threads, const std::string& isa,
                       const std::string& compute, const std::optional<std::string>& weights_dtype) {
             return ga::CausalSelfAttention(c, w.for_config(c), engine_options(threads, isa, compute, weights_dtype));
           }),
           py::arg("config"), py::arg("weights"), py::arg("threads") = 0, py::arg("isa") = "best",
           py::arg("compute") = "f32", py::arg("weights_dtype") = py::none(),
           "compute: 'f32' or 'bf16' (bf16 weights, projections and attention core with f32 accumulation; "
           "inputs and outputs stay float32 arrays). weights_dtype: None (the compute type), 'int8' (one scale per "
           "output row) or 'int4' (one per row and 32 inputs), quantized once here.")
      .def_static("from_safetensors", &layer_from_safetensors<ga::CausalSelfAttention>, py::arg("path"), py::arg("config"),
                  py::arg("prefix") = "", py::arg("threads") = 0, py::arg("isa") = "best", py::arg("compute") = "f32",
                  py::arg("weights_dtype") = py::none(),
                  "The layer of a safetensors file (torch or Hugging Face GPT-2 names after prefix), its tensors read "
                  "as stored: F32, F16 or BF16, converted once into the layer's compute type. config gives num_heads "
                  "and context_length, the file the sizes.")
      .def_static("from_quantized", &layer_from_quantized<ga::CausalSelfAttention>, py::arg("path"), py::arg("config"),
                  py::arg("threads") = 0, py::arg("isa") = "best", py::arg("compute") = "f32",
                  py::arg("weights_dtype") = py::none(),
                  "The layer of a file save_quantized (or `gpt2attn quantize`) wrote: its int8 or int4 codes as "
                  "saved. config gives num_heads and context_length, the file the sizes and the format; "
                  "weights_dtype: None (the file's) or the file's format.")
      .def(
          "forward",
          [](ga::CausalSelfAttention& self, const py::object& x, const py::object& out, int threads,
             ga::Workspace* ws) {
            py::array a = contiguous_f32(x, "x", {-1, -1, self.config().query_width()});
            const int64_t B = a.shape(0), T = a.shape(1);
            py::array y = output(out, {B, T, self.config().d_model});
            const float* src = static_cast<const float*>(a.data());
            float* dst = static_cast<float*>(y.mutable_data());
            {
              py::gil_scoped_release nogil;
              self.forward(src, B, T, dst, run_options(threads), ws);
            }
            return result(y, out, x);
          },
          py::arg("x"), py::arg("out") = py::none(), py::arg("threads") = 0, py::arg("workspace") = nullptr,
          "out (B, T, E) = causal self-attention of x (B, T, d_in), C-contiguous float32.")
      .def(
          "extend",
          [](ga::CausalSelfAttention& self, ga::KvCache& cache, ga::SequenceId seq, const py::object& x,
             const py::object& out, int threads, ga::Workspace* ws) {
            py::array a = contiguous_f32(x, "x", {-1, self.config().query_width()});
            const int64_t T = a.shape(0);
            py::array y = output(out, {T, self.config().d_model});
            const float* src = static_cast<const float*>(a.data());
            float* dst = static_cast<float*>(y.mutable_data());
            {
              py::gil_scoped_release nogil;
              self.extend(cache, seq, src, T, dst, run_options(threads), ws);
            }
            return result(y, out, x);
          },
          py::arg("cache"), py::arg("seq"), py::arg("x"), py::arg("out") = py::none(), py::arg("threads") = 0,
          py::arg("workspace") = nullptr,
          "Appends x (T, d_in) to sequence seq (prefill or a chunk of one) and returns its outputs (T, E).")
      .def(
          "decode",
          [](ga::CausalSelfAttention& self, ga::KvCache& cache, const std::vector<ga::SequenceId>& seqs,
             const py::object& x, const py::object& out, int threads, ga::Workspace* ws) {
            const int64_t B = static_cast<int64_t>(seqs.size());
            py::array a = contiguous_f32(x, "x", {B, self.config().query_width()});
            py::array y = output(out, {B, self.config().d_model});
            const float* src = static_cast<const float*>(a.data());
            float* dst = static_cast<float*>(y.mutable_data());
            {
              py::gil_scoped_release nogil;
              self.decode(cache, seqs.data(), B, src, dst, run_options(threads), ws);
            }
            return result(y, out, x);
          },
          py::arg("cache"), py::arg("seqs"), py::arg("x"), py::arg("out") = py::none(), py::arg("threads") = 0,
          py::arg("workspace") = nullptr,
          "One decode step: x (B, d_in) holds one new token for each of the B distinct sequences; returns (B, E).")
      .def(
          "step",
          [](ga::CausalSelfAttention& self, ga::KvCache& cache, const std::vector<ga::SequenceId>& seqs,
             const std::vector<int64_t>& tokens, const py::object& x, const py::object& out, int threads,
             ga::Workspace* ws) {
            if (tokens.size() != seqs.size()) {
              invalid("step: seqs has " + std::to_string(seqs.size()) + " entries and tokens " +
                      std::to_string(tokens.size()) + "; give one token count per sequence");
            }
            const int64_t n = static_cast<int64_t>(seqs.size());
            // x's rows are checked against sum(tokens) when the counts are ones the library takes (n >= 1, each in
            // 1..context_length, so the sum cannot overflow); otherwise the library refuses the counts, naming the
            // entry, before it reads x or writes out.
            const int64_t ctx = self.config().context_length;
            bool counts_ok = n >= 1;
            int64_t total = 0;
            for (int64_t t : tokens) {
              counts_ok = counts_ok && t >= 1 && t <= ctx;
              if (counts_ok) total += t;
            }
            py::array a = contiguous_f32(x, "x", {-1, self.config().query_width()});
            if (counts_ok && a.shape(0) != total) {
              invalid("x: shape " + shape_of(a) + ", expected (" + std::to_string(total) + ", " +
                      std::to_string(self.config().query_width()) + "): one row per new token, sum(tokens) = " +
                      std::to_string(total));
            }
            py::array y = output(out, {a.shape(0), self.config().d_model});
            const float* src = static_cast<const float*>(a.data());
            float* dst = static_cast<float*>(y.mutable_data());
            {
              py::gil_scoped_release nogil;
              self.step(cache, seqs.data(), tokens.data(), n, src, dst, run_options(threads), ws);
            }
            return result(y, out, x);
          },
          py::arg("cache"), py::arg("seqs"), py::arg("tokens"), py::arg("x"), py::arg("out") = py::none(),
          py::arg("threads") = 0, py::arg("workspace") = nullptr,
          "One continuous-batching step: entry i appends tokens[i] >= 1 new tokens to sequence seqs[i] (distinct "
          "sequences; a prompt chunk, one next token or draft tokens, in any mix). x (sum(tokens), d_in) holds the "
          "entries' tokens packed in entry order; returns (sum(tokens), E), each entry's rows as extend() of that "
          "entry alone gives them. A refused step changes no sequence.")
      .def(
          "reserve_serving",
          [](ga::CausalSelfAttention& self, int64_t max_extend_tokens, int64_t max_decode_batch, int threads,
             ga::Workspace* ws) {
            py::gil_scoped_release nogil;
            self.reserve_serving(max_extend_tokens, max_decode_batch, threads, ws);
          },
          py::arg("max_extend_tokens"), py::arg("max_decode_batch"), py::arg("threads") = 0,
          py::arg("workspace") = nullptr)
      .def(
          "reserve_step",
          [](ga::CausalSelfAttention& self, int64_t max_tokens, int64_t max_entries, int threads, ga::Workspace* ws) {
            py::gil_scoped_release nogil;
            self.reserve_step(max_tokens, max_entries, threads, ws);
          },
          py::arg("max_tokens"), py::arg("max_entries"), py::arg("threads") = 0, py::arg("workspace") = nullptr,
          "Grows the workspace (None: the layer's own) for step() of up to max_tokens tokens over up to max_entries "
          "entries, so that such a step allocates nothing of the library's own.")
      .def("step_workspace_bytes", &ga::CausalSelfAttention::step_workspace_bytes, py::arg("max_tokens"),
           py::arg("max_entries"), py::arg("threads") = 0, "The workspace bytes reserve_step() takes for these sizes.")
      // A copy: the layer's own Config, returned by reference, would let Python change the shape a built layer
      // trusts (layer.config.num_heads = 8), and forward would then index projections it never made.
      .def_property_readonly("config", [](const ga::CausalSelfAttention& s) { return s.config(); })
      .def_property_readonly("isa",
                             [](ga::CausalSelfAttention& s) { return std::string(ga::to_string(s.layer().isa())); })
      .def_property_readonly("implementation",
                             [](ga::CausalSelfAttention& s) { return s.layer().implementation(); });

  m.def(
      "reference_forward",
      // The Config by value: another Python thread may change the caller's while this one runs without the GIL.
      [](const ga::Config c, const PyWeights& pw, const py::object& query, const py::object& key,
         const py::object& value, const py::object& attn_mask, const std::optional<std::string>& mask_kind,
         const py::object& key_padding) {
        std::vector<py::object> keep;
        const ga::AttentionInputs in =
            attention_inputs(c.num_heads, query, key, value, attn_mask, mask_kind, key_padding, keep);
        const ga::Weights& w = pw.for_config(c);  // pw, an argument, outlives the call
        std::vector<double> r;
        {
          py::gil_scoped_release nogil;  // the naive reference takes seconds at GPT-2 sizes
          r = ga::reference_forward(c, w, in);
        }
        py::array_t<double> a(std::vector<py::ssize_t>{in.query.shape[0], in.query.shape[1], c.d_model});
        std::copy(r.begin(), r.end(), a.mutable_data());
        return result(a, py::none(), query);
      },
      py::arg("config"), py::arg("weights"), py::arg("query"), py::arg("key") = py::none(),
      py::arg("value") = py::none(), py::arg("attn_mask") = py::none(), py::arg("mask_kind") = py::none(),
      py::arg("key_padding") = py::none(),
      "The naive reference (double accumulation, shares nothing with the fast path): float64 (B, T, E).");

  // The address the compute calls would read `x` at: for tests that prove no copy is made.
  m.def("_input_address", [](const py::object& x) {
    return reinterpret_cast<uintptr_t>(as_f32(x, "x").data());
  });
}
