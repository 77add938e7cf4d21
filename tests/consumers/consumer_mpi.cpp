// tests/consumers/consumer_mpi.cpp: the smallest program against gpt2attn::mpi (run under mpiexec, any number of ranks
// up to 4, the layer's heads): a layer with random weights split across the ranks, a prompt of three tokens through
// a sharded KV cache and one decode step, compared on every rank with the same layer in one process
// (libgpt2attn.so); then an over-long extend, refused on every rank with an error caught here by type.
#include <gpt2attn/gpt2attn.hpp>
#include <gpt2attn/parallel.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace {

int run(int rank) {
  gpt2attn::Config cfg;
  cfg.d_model = 32;
  cfg.num_heads = 4;
  cfg.context_length = 8;
  cfg.causal = true;
  gpt2attn::KvCacheOptions pool;
  pool.capacity_tokens = 8;
  std::vector<float> x(8 * 32), want(8 * 32), got(8 * 32);  // (T, E), T up to context_length
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) / 7.0f - 0.5f;

  gpt2attn::CausalSelfAttention single(cfg, gpt2attn::Weights::random(cfg, 1));
  gpt2attn::KvCache cache(cfg, pool);
  const gpt2attn::SequenceId seq = cache.create();
  single.extend(cache, seq, x.data(), 3, want.data());
  single.decode(cache, &seq, 1, x.data() + 3 * 32, want.data() + 3 * 32);

  // The same seed gives Weights::random's values, each rank generating its own heads.
  gpt2attn::ShardedAttention sharded = gpt2attn::ShardedAttention::random(cfg, 1, MPI_COMM_WORLD);
  gpt2attn::ShardedKvCache sharded_cache(sharded, pool);
  const gpt2attn::SequenceId sharded_seq = sharded_cache.create();
  sharded.extend(sharded_cache, sharded_seq, x.data(), 3, got.data());
  sharded.decode(sharded_cache, &sharded_seq, 1, x.data() + 3 * 32, got.data() + 3 * 32);
  float err = 0;
  for (size_t i = 0; i < 4 * 32; ++i) err = std::max(err, std::fabs(got[i] - want[i]));
  if (!(err <= 1e-4f)) {
    std::printf("consumer_mpi: rank %d: sharded output differs from the single process by %g\n", rank, err);
    return 1;
  }
  try {
    sharded.extend(sharded_cache, sharded_seq, x.data(), 8, got.data());  // 4 cached + 8 > context_length
  } catch (const gpt2attn::Error& e) {  // thrown in libgpt2attn_mpi.so: the type must match across the boundary
    std::printf("consumer_mpi: rank %d of %d: heads %lld-%lld, max |sharded - single| %g, "
                "an over-long extend refused: %s\n",
                sharded.rank(), sharded.ranks(), static_cast<long long>(sharded.first_head()),
                static_cast<long long>(sharded.first_head() + sharded.heads() - 1), err, e.what());
    return 0;
  }
  std::printf("consumer_mpi: rank %d: an over-long extend was accepted\n", rank);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 1;
  try {
    status = run(rank);
  } catch (const std::exception& e) {
    std::printf("consumer_mpi: rank %d: %s\n", rank, e.what());
  }
  // Every rank's verdict: the job fails when any rank does, whatever mpiexec makes of exit statuses.
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
