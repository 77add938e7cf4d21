// tools/cli/main.cpp: the command-line tool `gpt2attn`: dispatch on the command (forward, quantize, bench, presets,
// serve; one file each; generate and logits, the whole model's, share one), its errors turned into the exit status: 0 ok,
// 2 bad input (one line on stderr), 1 internal error.
// Only main() exits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "gpt2attn/gpt2attn.h"
#include "tools/cli/commands.hpp"
#ifdef GPT2ATTN_HAVE_MPI
#include <mpi.h>

#include "gpt2attn/parallel.hpp"
#endif

namespace gpt2attn::cli {

namespace {

World g_world;
// Set when a collective passed its deadline on this rank: main() then ends the job with MPI_Abort.
bool g_abort_job = false;

// The rules every command shares, printed after the commands' tables.
const char* kNotes = R"(--isa caps the instruction set of the whole layer or model: gpt2attn's kernels, and oneDNN's GEMMs (avx512_bf16:
oneDNN's avx512_core_bf16, so no AMX; avx512: avx512_core; avx2: avx2; scalar: sse41), unless ONEDNN_MAX_CPU_ISA or
DNNL_MAX_CPU_ISA is set in the environment, which is then kept; best caps neither. Below avx512 oneDNN has no
bf16 GEMM, and --dtype bf16 projections multiply the bf16-rounded values in f32 GEMMs.
--threads N is 1 to 1024 (default: every core OpenMP offers); --repeats N is 1 to 2147483647; --heads,
--kv-heads, --context-length, --batch and --seq are 1 or more. A value out of range is refused, never narrowed.
An option that takes one value (all but bench's --preset, --dtype, --kv-dtype and --kv-heads, and generate's
--prompt-ids) given twice is refused; so is a value given twice to one of those five.

exit status: 0 success, 2 bad input or usage, 1 internal error.
)";

const std::vector<const Command*>& commands() {
  static const std::vector<const Command*> all = {&forward_command(), &quantize_command(), &bench_command(),
                                                  &presets_command(), &generate_command(), &logits_command(),
                                                  &serve_command()};
  return all;
}

void print_help() {
  if (g_world.prints()) std::fputs(render_help(commands(), kNotes).c_str(), stdout);
}

// The command, with its errors turned into the exit status and one line on stderr (printed by rank 0 alone under
// mpirun: every rank of a tensor-parallel call gets the same error).
int run(int argc, char** argv) {
  const std::string name = argc > 1 ? argv[1] : "";
  auto say = [](const char* fmt, const char* what) {
    if (g_world.prints()) std::fprintf(stderr, fmt, what);
  };
  try {
    for (const Command* c : commands()) {
      if (name != c->name) continue;
      // A command without options (presets) takes none and, as it always has, ignores what follows it.
      return c->run(c->options.empty() ? Args{} : Args::parse(*c, argc, argv, 2));
    }
    if (name == "--help" || name == "-h" || name == "help") {
      print_help();
      return 0;
    }
    if (name == "--version") {
      if (g_world.prints()) std::printf("gpt2attn %s\n", gpt2attn_version());
      return 0;
    }
    throw UsageError(name.empty() ? "missing command (forward, quantize, bench, presets, generate, logits or serve)"
                                  : "unknown command '" + name + "'");
  } catch (const HelpRequested&) {
    print_help();
    return 0;
  } catch (const UsageError& e) {
    say("gpt2attn: %s (see gpt2attn --help)\n", e.what());
    return 2;
#ifdef GPT2ATTN_HAVE_MPI
  } catch (const CollectiveTimeout& e) {
    // Printed by the rank that waited, whichever it is: the others are stopped, or waiting too.
    std::fprintf(stderr, "gpt2attn: %s\n", e.what());
    g_abort_job = true;
    return 1;
#endif
  } catch (const Error& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    say("gpt2attn: %s\n", msg.c_str());
    return e.code() == ErrorCode::internal ? 1 : 2;
  } catch (const std::bad_alloc&) {
    say("gpt2attn: %s\n", "out of memory");
    return 2;
  } catch (const std::exception& e) {
    say("gpt2attn: internal error: %s\n", e.what());
    return 1;
  }
}

}  // namespace

const World& world() { return g_world; }

Option mpi_timeout_row() {
  Option o = value("mpi-timeout", "SECONDS", "under mpirun: seconds a rank waits inside one collective for the ");
#ifdef GPT2ATTN_HAVE_MPI
  o.help += "others before it ends the job; default " + std::to_string(static_cast<int>(kCollectiveDeadlineS)) + ".";
#else
  o.help += "others (this build has no MPI).";
#endif
  return o;
}

double mpi_timeout_option(const Args& a) {
#ifdef GPT2ATTN_HAVE_MPI
  constexpr double def = kCollectiveDeadlineS;
#else
  constexpr double def = 0;  // never used: without MPI nothing waits in a collective
#endif
  if (!a.has("mpi-timeout")) return def;
  const std::string s = a.get("mpi-timeout");
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0) {
    throw UsageError("--mpi-timeout " + s + ": expected a number of seconds above 0 (such as 600 or 0.5)");
  }
  return v;
}

}  // namespace gpt2attn::cli

int main(int argc, char** argv) {
  using gpt2attn::cli::g_world;
  // MPI only when mpirun (or another PMI launcher) started this process: a plain run never initialises it.
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  if (!launched) return gpt2attn::cli::run(argc, argv);
#ifdef GPT2ATTN_HAVE_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world.ranks);
  const int status = gpt2attn::cli::run(argc, argv);
  // A collective left waiting on a stopped rank cannot be cancelled, and MPI_Finalize would wait for it: only
  // MPI_Abort ends the job, making mpirun end every rank, the stopped one included.
  if (gpt2attn::cli::g_abort_job) MPI_Abort(MPI_COMM_WORLD, status);
  MPI_Finalize();
  return status;
#else
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size && std::atoi(size) > 1) {
    std::fprintf(stderr, "gpt2attn: started by mpirun with %s ranks, but this build has no MPI support\n", size);
    return 2;
  }
  return gpt2attn::cli::run(argc, argv);
#endif
}
