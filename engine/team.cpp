// engine/team.cpp: FirstError's two functions (engine/team.hpp), out of line so that they exist once, built with the
// baseline flags; and the public run_on_threads over team_run.
#include "engine/team.hpp"

#include <string>
#include <utility>

#include "gpt2attn/error.hpp"
#include "gpt2attn/options.hpp"

namespace gpt2attn {

int run_on_threads(int threads, const std::function<void(int thread, int team)>& f) {
  if (threads < 1 || threads > max_threads()) {
    invalid("run_on_threads: threads = " + std::to_string(threads) + " (must be 1.." +
                    std::to_string(max_threads()) + ")");
  }
  return detail::team_run(threads, f);
}

}  // namespace gpt2attn

namespace gpt2attn::detail {

void FirstError::rethrow() const {
  if (error_) std::rethrow_exception(error_);
}

void FirstError::keep(std::exception_ptr e) noexcept {
#pragma omp critical(gpt2attn_team_error)
  if (!error_) error_ = std::move(e);
}

}  // namespace gpt2attn::detail
