// tools/cli/commands.hpp: the commands main() dispatches on (one file each), and the MPI world they run in.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tools/cli/options.hpp"

namespace gpt2attn {
class GPT2;
}

namespace gpt2attn::cli {

// The MPI world. Under mpirun with more than one rank, forward and bench run tensor parallel (gpt2attn/parallel.hpp):
// every rank computes its heads, rank 0 alone writes files and prints. Without mpirun MPI is never initialised.
struct World {
  int rank = 0, ranks = 1;
  bool parallel() const { return ranks > 1; }
  bool prints() const { return rank == 0; }
};
const World& world();  // set once by main() before any command runs

// --mpi-timeout SECONDS (forward and bench): under mpirun, how long a rank waits inside one collective for the others
// (ShardedAttention's deadline_s); a rank past it prints the error and main() ends the job with MPI_Abort, since MPI
// cannot cancel the collective the stopped rank never joined. Above 0 and finite; absent: the library's default.
Option mpi_timeout_row();
double mpi_timeout_option(const Args& a);

// Built on first use (their tables read the library's lists), never during static initialisation.
const Command& forward_command();   // tools/cli/forward.cpp
const Command& quantize_command();  // tools/cli/quantize.cpp
const Command& bench_command();     // tools/cli/bench.cpp
const Command& presets_command();   // tools/cli/presets.cpp
const Command& generate_command();  // tools/cli/generate.cpp
const Command& logits_command();    // tools/cli/generate.cpp
const Command& serve_command();     // tools/cli/serve.cpp

// The whole model's options, which generate, logits and serve share (tools/cli/generate.cpp):
std::vector<Option> model_rows();              // --model DIR, --preset NAME, --seed-weights S
Option cache_dtype_row();                      // --kv-dtype given once: the model's cache's storage type
EngineOptions engine_options(const Args& a);   // --dtype, --weights-dtype, --threads, --isa
void check_model_options(const Args& a);       // one of --model and --preset, checked before anything is read
GPT2 load_model(const Args& a, const EngineOptions& opts);  // the checkpoint or the preset's random weights

// What forward and quantize share about the files they read and write (tools/cli/layer_files.cpp).
// --output naming one of `inputs` ({option, path}; empty paths skipped) is a UsageError: writing would replace it.
void refuse_output_over_inputs(const std::string& output,
                               const std::vector<std::pair<const char*, std::string>>& inputs);
// The shape `said` (a --config file's or a preset's, named by `source`) gives the layer must be the shape of
// `layer`, completed from the weights file `weights`: invalid_argument naming the first field that differs.
void check_config_against_weights(const Config& said, const std::string& source, const Config& layer,
                                  const std::string& weights);

}  // namespace gpt2attn::cli
