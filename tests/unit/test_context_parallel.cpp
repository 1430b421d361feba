// Context-parallel attention (models/common/context_parallel.hpp) against
// the one-rank kernels (common/layers.hpp): cp ranks run as threads over an in-memory group,
// each computing its rows of the same sequences; its output and its rows'
// q/k/v gradients must be the whole sequence's at those rows' positions.
// float32 sums in another order (blocks merged by log-sum-exp): 2e-5.
// The same ranks on fenced computes (fenced_compute.hpp: memory the host
// cannot touch outside the compute's calls, as a GPU's) must give the host
// compute's results bit for bit: every step is a call of the compute and
// every transfer moves the compute's memory.
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "common/buffer.hpp"
#include "common/context_parallel.hpp"
#include "common/layers.hpp"
#include "fenced_compute.hpp"

namespace {

using meshrun::kernels::AttentionShape;
using meshrun::models::ContextParallel;
using meshrun::models::ContextParallelGroup;
using meshrun::models::SequenceAttention;
using meshrun::models::SequenceShard;

using meshrun::models::Buffer;
using meshrun::models::Compute;

// Messages between the threads of one test, by (from, to), in order.
class Mailboxes {
 public:
  void post(int64_t from, int64_t to, std::vector<float> message) {
    std::lock_guard<std::mutex> lock(mutex_);
    boxes_[{from, to}].push_back(std::move(message));
    arrived_.notify_all();
  }
  std::vector<float> take(int64_t from, int64_t to) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& box = boxes_[{from, to}];
    arrived_.wait(lock, [&] { return !box.empty(); });
    std::vector<float> message = std::move(box.front());
    box.erase(box.begin());
    return message;
  }

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<float>>> boxes_;
};

// A cp rank of the threads, over its compute's memory: an all-to-all's
// pieces are copied out at its start, the received ones land in
// wait_started.
class ThreadGroup : public ContextParallelGroup {
 public:
  ThreadGroup(Mailboxes& mail, int64_t size, int64_t rank,
              Compute& compute = meshrun::models::host_compute())
      : mail_(mail), size_(size), rank_(rank), compute_(compute) {}
  int64_t size() const override { return size_; }
  int64_t rank() const override { return rank_; }
  void all_reduce_sum(float* /*data*/, int64_t /*count*/) override {
    throw std::logic_error("attention does not all-reduce");
  }
  void start_all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                        const std::vector<int64_t>& recv_counts) override {
    REQUIRE(int64_t(send_counts.size()) == size_);
    REQUIRE(int64_t(recv_counts.size()) == size_);
    for (int64_t peer = 0; peer < size_; ++peer) {
      const int64_t count = send_counts[size_t(peer)];
      if (count > 0) {
        std::vector<float> piece(static_cast<size_t>(count));
        compute_.copy_to_host(piece.data(), send, count * int64_t(sizeof(float)));
        mail_.post(rank_, peer, std::move(piece));
      }
      send += count;
      if (recv_counts[size_t(peer)] > 0)
        pending_.push_back({recv, recv_counts[size_t(peer)], peer});
      recv += recv_counts[size_t(peer)];
    }
  }
  void wait_started() override {
    for (const Pending& p : pending_) {
      const std::vector<float> message = mail_.take(p.peer, rank_);
      REQUIRE(int64_t(message.size()) == p.count);
      compute_.copy_from_host(p.data, message.data(), p.count * int64_t(sizeof(float)));
    }
    pending_.clear();
  }

 private:
  struct Pending {
    float* data;
    int64_t count, peer;
  };
  Mailboxes& mail_;
  int64_t size_, rank_;
  Compute& compute_;
  std::vector<Pending> pending_;
};

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(generator);
  return values;
}

// Rows of `full` [batch, seq_len, width] at each local row's position.
std::vector<float> local_rows(const std::vector<float>& full, const SequenceShard& shard,
                              int64_t batch, int64_t width) {
  const std::vector<int64_t> positions = shard.positions();
  std::vector<float> local;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t position : positions) {
      const auto row = full.begin() + (b * shard.seq_len + position) * width;
      local.insert(local.end(), row, row + width);
    }
  }
  return local;
}

// Each rank's output and q/k/v gradients.
struct RankResults {
  std::vector<std::vector<float>> out, d_qkv;
};

// A host vector's copy in `compute`'s memory.
Buffer<float> on(Compute& compute, const std::vector<float>& values) {
  Buffer<float> buffer(values.size(), compute);
  compute.copy_from_host(buffer.data(), values.data(), int64_t(values.size() * sizeof(float)));
  return buffer;
}

std::vector<float> from(Compute& compute, const Buffer<float>& buffer) {
  std::vector<float> values(buffer.size());
  compute.copy_to_host(values.data(), buffer.data(), int64_t(values.size() * sizeof(float)));
  return values;
}

// Attention forward and backward over cp = ring x ulysses threads, each on
// the host's compute or a fenced one of its own.
RankResults over_cp_ranks(const AttentionShape& full, int64_t ring, int64_t ulysses,
                          int64_t query_block, const std::vector<float>& qkv,
                          const std::vector<float>& d_out, bool fenced) {
  const int64_t cp = ring * ulysses;
  Mailboxes mail;
  RankResults results{std::vector<std::vector<float>>(size_t(cp)),
                      std::vector<std::vector<float>>(size_t(cp))};
  std::vector<std::thread> threads;
  for (int64_t rank = 0; rank < cp; ++rank) {
    threads.emplace_back([&, rank] {
      fenced::FencedCompute own;
      Compute& compute = fenced ? own : meshrun::models::host_compute();
      ThreadGroup group(mail, cp, rank, compute);
      AttentionShape local = full;
      local.seq_len = full.seq_len / cp;
      local.query_block = query_block;
      SequenceAttention attention(local, ContextParallel{&group, ring, ulysses}, "test", compute);
      const SequenceShard shard{cp, rank, full.seq_len};
      const Buffer<float> my_qkv = on(compute, local_rows(qkv, shard, full.batch, full.qkv_dim()));
      const Buffer<float> my_d_out =
          on(compute, local_rows(d_out, shard, full.batch, full.q_dim()));
      Buffer<float> my_out(my_d_out.size(), compute), my_lse(size_t(local.lse_size()), compute);
      Buffer<float> my_d_qkv(my_qkv.size(), compute);
      attention.forward(my_out.data(), my_lse.data(), my_qkv.data());
      attention.backward(my_d_qkv.data(), my_d_out.data(), my_qkv.data(), my_out.data(),
                         my_lse.data());
      results.out[size_t(rank)] = from(compute, my_out);
      results.d_qkv[size_t(rank)] = from(compute, my_d_qkv);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

void check_against_one_rank(int64_t ring, int64_t ulysses, int64_t query_block) {
  const int64_t cp = ring * ulysses;
  AttentionShape full{2, 8 * cp, 4, 2, 8, 64};
  const int64_t rows = full.batch * full.seq_len;
  const std::vector<float> qkv = random_values(size_t(rows * full.qkv_dim()), 1);
  const std::vector<float> d_out = random_values(size_t(rows * full.q_dim()), 2);
  std::vector<float> out(size_t(rows * full.q_dim())), lse(size_t(full.lse_size()));
  std::vector<float> d_qkv(qkv.size());
  // One rank: the plain kernels, as the model library compiles them (a copy
  // instantiated here, with other flags, could replace the library's).
  SequenceAttention one_rank(full, ContextParallel{}, "test");
  one_rank.forward(out.data(), lse.data(), qkv.data());
  one_rank.backward(d_qkv.data(), d_out.data(), qkv.data(), out.data(), lse.data());

  const RankResults host = over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, false);
  for (int64_t rank = 0; rank < cp; ++rank) {
    const SequenceShard shard{cp, rank, full.seq_len};
    const std::vector<float> want_out = local_rows(out, shard, full.batch, full.q_dim());
    const std::vector<float> want_d_qkv = local_rows(d_qkv, shard, full.batch, full.qkv_dim());
    for (size_t i = 0; i < want_out.size(); ++i) {
      REQUIRE(host.out[size_t(rank)][i] == Approx(want_out[i]).margin(2e-5).epsilon(2e-5));
    }
    for (size_t i = 0; i < want_d_qkv.size(); ++i) {
      REQUIRE(host.d_qkv[size_t(rank)][i] == Approx(want_d_qkv[i]).margin(2e-5).epsilon(2e-5));
    }
  }
  const RankResults fenced = over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, true);
  CHECK(fenced.out == host.out);
  CHECK(fenced.d_qkv == host.d_qkv);
}

}  // namespace

TEST_CASE("a cp rank keeps chunks i and 2 cp - 1 - i of each sequence") {
  const SequenceShard first{2, 0, 8}, second{2, 1, 8};
  CHECK(first.positions() == std::vector<int64_t>{0, 1, 6, 7});
  CHECK(second.positions() == std::vector<int64_t>{2, 3, 4, 5});
  const std::vector<int32_t> tokens{10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25, 26, 27};
  std::vector<int32_t> local(8);
  second.select(tokens.data(), local.data(), 2);
  CHECK(local == std::vector<int32_t>{12, 13, 14, 15, 22, 23, 24, 25});
}

TEST_CASE("ring attention over cp ranks computes one rank's attention") {
  check_against_one_rank(2, 1, 64);
  check_against_one_rank(4, 1, 3);
}

TEST_CASE("Ulysses attention over cp ranks computes one rank's attention") {
  check_against_one_rank(1, 2, 64);
}

TEST_CASE("ring x Ulysses attention computes one rank's attention") {
  check_against_one_rank(2, 2, 5);
}

TEST_CASE("the plan's context-parallel degrees must fit the cp group") {
  Mailboxes mail;
  ThreadGroup group(mail, 4, 0);
  const ContextParallel cp = meshrun::models::plan_context_parallel(
      R"({"context_parallel": {"ring_degree": 2, "ulysses_degree": 2}})", &group, "test");
  CHECK((cp.ring_degree == 2 && cp.ulysses_degree == 2));
  CHECK(meshrun::models::plan_context_parallel("{}", &group, "test").ring_degree == 4);
  CHECK_THROWS_WITH(meshrun::models::plan_context_parallel(
                        R"({"context_parallel": {"ring_degree": 3}})", &group, "test"),
                    Catch::Contains("ring degree 3 x Ulysses degree 1 is not the cp group's 4"));
}
