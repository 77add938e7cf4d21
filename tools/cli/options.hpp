// tools/cli/options.hpp: each command's options as one table, which both parses the command line and renders
// `gpt2attn --help`. The rules every command shares: an option given twice is refused unless the table says it
// repeats, a value given twice to one that repeats is refused, an option's value that is itself an option is
// refused, and an integer out of its range is refused, never narrowed.
#pragma once

#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpt2attn/gpt2attn.hpp"

namespace gpt2attn::cli {

// A usage error: main prints it with "(see gpt2attn --help)" and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// `gpt2attn forward --help` and the like: main prints the usage and exits 0.
struct HelpRequested {};

struct Option {
  std::string name;   // without the leading --
  std::string value;  // the value's placeholder in --help ("N", "f32|bf16"); empty for a flag, which takes none
  bool repeatable;    // may be given more than once (each value once); the others are refused the second time
  bool required;      // shown bare in the synopsis; the command checks it
  std::string help;   // a line or two for --help
  bool is_flag() const { return value.empty(); }
};
// The table's rows: a flag, a single-valued option, a repeatable one, a required one.
inline Option flag(const char* name, const char* help) { return {name, "", false, false, help}; }
inline Option value(const char* name, std::string placeholder, const char* help) {
  return {name, std::move(placeholder), false, false, help};
}
inline Option values(const char* name, std::string placeholder, const char* help) {
  return {name, std::move(placeholder), true, false, help};
}
inline Option required(const char* name, std::string placeholder, const char* help) {
  return {name, std::move(placeholder), false, true, help};
}
// The rows several commands share. Their value lists are the library's (compiled_isas(), kv_cache_dtypes()), so a
// new instruction set or K/V format reaches --help and the parsers without an edit here.
Option threads_row();
Option isa_row();
Option compute_row(bool repeatable);  // --dtype
Option kv_dtype_row();                // --kv-dtype, repeatable
Option weights_row(bool repeatable);  // --weights-dtype

class Args;
struct Command {
  const char* name;
  const char* summary;  // one line, for the command list
  std::vector<Option> options;
  const char* about;    // prose printed below the options: what the command computes and reports
  int (*run)(const Args&);
};

// A command's options as given: flags, and every value of each option in order.
class Args {
 public:
  // argv[first..] against the command's table: unknown options, a missing value, a value that is an option, and a
  // single-valued option given twice are refused (UsageError); --help or -h anywhere throws HelpRequested.
  static Args parse(const Command& cmd, int argc, char** argv, int first);

  bool flag(const std::string& f) const;
  bool has(const std::string& k) const { return values_.count(k) != 0; }
  // The value of single-valued option --k (`def` when absent).
  std::string get(const std::string& k, const std::string& def = "") const;
  // Its value, or "missing required option --k".
  std::string required(const std::string& k) const;
  // The value of integer option --k (`def` when absent) as the type I it is stored in, refused unless it lies in
  // [min_value, max_value]: a value is never narrowed after the check (--threads 4294967296 is not 0).
  template <class I>
  I integer(const std::string& k, I def, I min_value, I max_value = std::numeric_limits<I>::max()) const {
    return has(k) ? integer_of<I>(k, get(k), min_value, max_value) : def;
  }
  // Every value of repeatable option --k in the order given (none when absent), each read by `read` (which refuses
  // a bad one); a value read twice is refused: a repeat would run or report a case twice.
  template <class T, class Read>
  std::vector<T> distinct(const std::string& k, Read&& read) const {
    std::vector<T> out;
    if (!has(k)) return out;
    for (const std::string& s : values_.at(k)) {
      T v = read(s);
      for (const T& seen : out) {
        if (seen == v) throw UsageError("--" + k + " " + s + " given twice");
      }
      out.push_back(std::move(v));
    }
    return out;
  }
  // Every value of a repeatable integer option, each checked as integer() checks one.
  template <class I>
  std::vector<I> integers(const std::string& k, I min_value, I max_value = std::numeric_limits<I>::max()) const {
    return distinct<I>(k, [&](const std::string& s) { return integer_of<I>(k, s, min_value, max_value); });
  }

 private:
  template <class I>
  static I integer_of(const std::string& k, const std::string& s, I min_value, I max_value) {
    static_assert(std::is_signed_v<I> && sizeof(I) <= sizeof(long long));
    return static_cast<I>(integer_in(k, s, min_value, max_value));
  }
  static long long integer_in(const std::string& k, const std::string& s, long long min_value, long long max_value);

  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> flags_;
};

// One of `allowed` (the option's value as given), or "--k <s> is not supported (supported: a, b)".
std::string choice(const std::string& k, const std::string& s, const std::vector<std::string>& allowed);
// --isa (default best) by the library's names; an unknown name is a usage error that says which option it was.
Isa isa_option(const Args& a);
// The compute types --dtype asks for (f32 or bf16), in the order given; f32 when absent.
std::vector<DType> compute_dtypes(const Args& a);
// The K/V storage types --kv-dtype asks for, by the names given ("int8" or "i8" as given), in order; {"f32"} when
// absent. A name that is not a K/V format of the library is a usage error listing those.
std::vector<std::string> kv_dtype_names(const Args& a);
// --weights-dtype's values as given ("compute" when absent), and one of them for a case computing in `compute`: f32 or
// bf16 must name the compute type (a UsageError otherwise), int8 and int4 quantize.
std::vector<std::string> weights_dtype_names(const Args& a);
WeightFormat weight_format_for(const std::string& name, DType compute);
// --threads: 1 to the library's max_threads() limit; 0 (every core OpenMP offers) when absent.
int threads_option(const Args& a);

// The whole --help text: usage, each command's options and prose, then `notes`, the rules all commands share.
std::string render_help(const std::vector<const Command*>& commands, const char* notes);

}  // namespace gpt2attn::cli
