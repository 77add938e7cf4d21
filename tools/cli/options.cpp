// tools/cli/options.cpp: parsing a command's options against its table, and rendering the tables as --help.
#include "tools/cli/options.hpp"

#include <algorithm>
#include <sstream>

namespace gpt2attn::cli {

namespace {

const Option* find(const Command& cmd, const std::string& name) {
  for (const Option& o : cmd.options) {
    if (name == o.name) return &o;
  }
  return nullptr;
}

// Words of `text` filled into lines of at most `width` columns, each line after the first indented by `indent`.
std::string fill(const std::string& text, size_t first_col, size_t indent, size_t width = 118) {
  std::istringstream words(text);
  std::string word, out;
  size_t col = first_col;
  bool first = true;
  while (words >> word) {
    if (!first && col + 1 + word.size() > width) {
      out += '\n';
      out.append(indent, ' ');
      col = indent;
    } else if (!first) {
      out += ' ';
      ++col;
    }
    out += word;
    col += word.size();
    first = false;
  }
  return out;
}

}  // namespace

Args Args::parse(const Command& cmd, int argc, char** argv, int first) {
  Args a;
  for (int i = first; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") throw HelpRequested{};
    if (s.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + s + "'");
    s = s.substr(2);
    const Option* o = find(cmd, s);
    if (o == nullptr) throw UsageError("unknown option --" + s);
    if (o->is_flag()) {
      a.flags_.push_back(s);
      continue;
    }
    if (i + 1 >= argc) throw UsageError("option --" + s + " needs a value");
    // `--output --causal` would otherwise write a file named "--causal" and compute without the mask.
    const std::string value = argv[i + 1];
    if (value == "--help" || (value.rfind("--", 0) == 0 && find(cmd, value.substr(2)) != nullptr)) {
      throw UsageError("option --" + s + " needs a value, got the option " + value);
    }
    std::vector<std::string>& given = a.values_[s];
    // A second value of a single-valued option is refused rather than the last one silently taken.
    if (!o->repeatable && !given.empty()) throw UsageError("--" + s + " given more than once");
    given.push_back(argv[++i]);
  }
  return a;
}

bool Args::flag(const std::string& f) const { return std::find(flags_.begin(), flags_.end(), f) != flags_.end(); }

std::string Args::get(const std::string& k, const std::string& def) const {
  auto it = values_.find(k);
  if (it == values_.end()) return def;
  if (it->second.size() > 1) throw UsageError("--" + k + " given more than once");
  return it->second.front();
}

std::string Args::required(const std::string& k) const {
  if (!has(k)) throw UsageError("missing required option --" + k);
  return get(k);
}

long long Args::integer_in(const std::string& k, const std::string& s, long long min_value, long long max_value) {
  const size_t digits = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;  // one optional sign
  if (s.size() == digits || s.find_first_not_of("0123456789", digits) != std::string::npos) {
    throw UsageError("--" + k + ": expected an integer, got '" + s + "'");
  }
  const std::string range =
      "must be in [" + std::to_string(min_value) + ", " + std::to_string(max_value) + "], got " + s;
  long long v = 0;
  try {
    v = std::stoll(s);
  } catch (const std::out_of_range&) {  // beyond int64, so beyond every I
    throw UsageError("--" + k + ": " + range + " (out of the 64-bit range)");
  }
  if (v < min_value || v > max_value) throw UsageError("--" + k + ": " + range);
  return v;
}

namespace {
std::string joined(const std::vector<std::string>& names, const char* sep) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : sep) + n;
  return s;
}
}  // namespace

std::string choice(const std::string& k, const std::string& s, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  throw UsageError("--" + k + " " + s + " is not supported (supported: " + joined(allowed, ", ") + ")");
}

Isa isa_option(const Args& a) {
  try {
    return isa_from_string(a.get("isa", "best"));
  } catch (const Error& e) {
    throw UsageError(std::string("--isa: ") + e.what());
  }
}

std::vector<DType> compute_dtypes(const Args& a) {
  if (!a.has("dtype")) return {DType::f32};
  return a.distinct<DType>("dtype", [](const std::string& dt) {
    return dtype_from_string(choice("dtype", dt, {"f32", "bf16"}));
  });
}

int threads_option(const Args& a) { return a.integer<int>("threads", 0, 1, max_threads()); }

namespace {
// The CLI's name of a K/V format: the library's, but "int8" for i8 (the name --kv-dtype has always taken).
std::string kv_name(DType t) { return t == DType::i8 ? "int8" : to_string(t); }
std::vector<std::string> kv_names() {
  std::vector<std::string> names;
  for (DType t : kv_cache_dtypes()) names.push_back(kv_name(t));
  return names;
}
}  // namespace

std::vector<std::string> kv_dtype_names(const Args& a) {
  std::vector<std::string> given = a.distinct<std::string>("kv-dtype", [](const std::string& n) {
    choice("kv-dtype", n == "i8" ? "int8" : n, kv_names());
    return n;
  });
  if (given.empty()) given = {"f32"};
  return given;
}

Option threads_row() { return value("threads", "N", "threads; default every core OpenMP offers."); }

Option isa_row() {
  std::vector<std::string> names = {"best"};
  for (Isa isa : compiled_isas()) names.push_back(to_string(isa));
  return value("isa", joined(names, "|"), "the instruction set cap (see below); default best.");
}

Option compute_row(bool repeatable) {
  Option o = value("dtype", "f32|bf16", "the compute type; default f32.");
  o.repeatable = repeatable;
  return o;
}

Option weights_row(bool repeatable) {
  Option o = value("weights-dtype", "f32|bf16|int8|int4",
                   "the projection weights: the compute type (default), or int8 / int4 quantized at load.");
  o.repeatable = repeatable;
  return o;
}

std::vector<std::string> weights_dtype_names(const Args& a) {
  std::vector<std::string> given = a.distinct<std::string>("weights-dtype", [](const std::string& n) {
    return choice("weights-dtype", n, {"f32", "bf16", "int8", "int4"});
  });
  if (given.empty()) given = {"compute"};
  return given;
}

WeightFormat weight_format_for(const std::string& name, DType compute) {
  if (name == "int8" || name == "int4") return weight_format_from_string(name);
  if (name != "compute" && name != to_string(compute)) {
    throw UsageError("--weights-dtype " + name + " with --dtype " + to_string(compute) +
                     ": unquantized weights are held in the compute type (give --weights-dtype " +
                     to_string(compute) + ", int8 or int4)");
  }
  return WeightFormat::compute;
}

Option kv_dtype_row() {
  return values("kv-dtype", joined(kv_names(), "|"), "decode: the KV cache's storage type; default f32.");
}

std::string render_help(const std::vector<const Command*>& commands, const char* notes) {
  std::string out = "usage:\n  gpt2attn --version | --help\n";
  // The synopsis: required options bare, the others in brackets, a repeatable one followed by "...".
  for (const Command* c : commands) {
    std::string line = std::string("gpt2attn ") + c->name;
    const size_t indent = 2 + line.size() + 1;
    std::string words;
    for (const Option& o : c->options) {
      std::string w = "--" + o.name + (o.is_flag() ? "" : " " + o.value);
      if (o.repeatable) w += " ...";
      if (!o.required) w = "[" + w + "]";
      // One option is one unbreakable word of the fill: non-breaking until filled, then spaces again.
      std::replace(w.begin(), w.end(), ' ', '\x1f');
      words += " " + w;
    }
    std::string filled = fill(line + words, 2, indent);
    std::replace(filled.begin(), filled.end(), '\x1f', ' ');
    out += "  " + filled + "\n";
  }
  for (const Command* c : commands) {
    out += std::string("\n") + c->name + ": " + c->summary + "\n";
    size_t width = 0;
    for (const Option& o : c->options) {
      width = std::max(width, o.name.size() + (o.is_flag() ? 0 : o.value.size() + 1));
    }
    const size_t col = 2 + 2 + width + 2;
    for (const Option& o : c->options) {
      std::string head = "--" + o.name + (o.is_flag() ? "" : " " + o.value);
      head.resize(2 + width + 2, ' ');
      std::string help = o.help;
      if (o.repeatable) help += " Repeatable, each value once.";
      if (o.required) help += " Required.";
      out += "  " + head + fill(help, col, col) + "\n";
    }
    if (c->about && *c->about) {
      out += '\n';
      out += c->about;
    }
  }
  out += "\n";
  out += notes;
  return out;
}

}  // namespace gpt2attn::cli
