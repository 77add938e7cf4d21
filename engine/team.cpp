// engine/team.cpp: FirstError's two functions (engine/team.hpp), out of line so that they exist once, built with the
// baseline flags.
#include "engine/team.hpp"

#include <utility>

namespace gpt2attn::detail {

void FirstError::rethrow() const {
  if (error_) std::rethrow_exception(error_);
}

void FirstError::keep(std::exception_ptr e) noexcept {
#pragma omp critical(gpt2attn_team_error)
  if (!error_) error_ = std::move(e);
}

}  // namespace gpt2attn::detail
