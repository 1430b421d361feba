// Model-parallel ranks run as threads of one process: an in-memory group
// that serves as a stage's tp, cp and ep group, moving the collectives'
// pieces through the host (sums in rank order), each rank on a compute
// of its own (the host's, a fenced one, a GPU's). What the tests of
// tensor, context and expert parallelism without MPI run: ring and Ulysses
// attention against one rank's (tests/unit), a stage over such ranks
// (threaded_stages.hpp), and the GPU's against the host's (tests/gpu).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/buffer.hpp"
#include "common/context_parallel.hpp"
#include "common/expert_parallel.hpp"
#include "common/layers.hpp"
#include "common/tensor_parallel.hpp"

namespace threaded_ranks {

using meshrun::kernels::AttentionShape;
using meshrun::models::Buffer;
using meshrun::models::Compute;
using meshrun::models::ContextParallel;
using meshrun::models::ContextParallelGroup;
using meshrun::models::ExpertParallelGroup;
using meshrun::models::SequenceAttention;
using meshrun::models::SequenceShard;
using meshrun::models::TensorParallelGroup;

// Messages between the threads of one run, by (from, to), in order.
// Once a rank has failed (abandon()), a take that would wait throws
// PeerFailed instead, so the other ranks end rather than wait for a
// message that never comes.
struct PeerFailed : std::runtime_error {
  PeerFailed() : std::runtime_error("stopped: another rank failed") {}
};

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
    arrived_.wait(lock, [&] { return !box.empty() || abandoned_; });
    if (box.empty()) throw PeerFailed();
    std::vector<float> message = std::move(box.front());
    box.erase(box.begin());
    return message;
  }
  void abandon() {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = true;
    arrived_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<float>>> boxes_;
  bool abandoned_ = false;
};

// A rank of the threads, over its compute's memory: an all-to-all's
// pieces are copied out at its start, the received ones land in
// wait_started (at once for the ep group's all_to_all). Throws
// std::logic_error for counts of the wrong size or a message of another
// length than expected.
class ThreadGroup : public TensorParallelGroup,
                    public ContextParallelGroup,
                    public ExpertParallelGroup {
 public:
  ThreadGroup(Mailboxes& mail, int64_t size, int64_t rank,
              Compute& compute = meshrun::models::host_compute())
      : mail_(mail), size_(size), rank_(rank), compute_(compute) {}
  int64_t size() const override { return size_; }
  int64_t rank() const override { return rank_; }
  // Every rank's values combined in rank order, so every rank gets the
  // same bits.
  void all_reduce_sum(float* data, int64_t count) override {
    combine(data, count, [](float a, float b) { return a + b; });
  }
  void all_reduce_max(float* data, int64_t count) override {
    combine(data, count, [](float a, float b) { return a > b ? a : b; });
  }
  void all_gather(const float* send, float* recv, int64_t count) override {
    const std::vector<std::vector<float>> parts = gathered(send, count);
    for (int64_t r = 0; r < size_; ++r) {
      compute_.copy_from_host(recv + r * count, parts[size_t(r)].data(), bytes(count));
    }
  }
  void reduce_scatter_sum(const float* send, float* recv, int64_t count) override {
    std::vector<float> mine;
    for (int64_t peer = 0; peer < size_; ++peer) {
      std::vector<float> piece = host_copy(send + peer * count, count);
      if (peer == rank_) {
        mine = std::move(piece);
      } else {
        mail_.post(rank_, peer, std::move(piece));
      }
    }
    std::vector<float> sum(mine.size(), 0.0f);
    for (int64_t peer = 0; peer < size_; ++peer) {
      const std::vector<float> part = peer == rank_ ? mine : mail_.take(peer, rank_);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    compute_.copy_from_host(recv, sum.data(), bytes(count));
  }
  void start_all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                        const std::vector<int64_t>& recv_counts) override {
    if (int64_t(send_counts.size()) != size_ || int64_t(recv_counts.size()) != size_) {
      throw std::logic_error("all_to_all: counts for another group size");
    }
    for (int64_t peer = 0; peer < size_; ++peer) {
      const int64_t count = send_counts[size_t(peer)], receiving = recv_counts[size_t(peer)];
      if (count > 0) {
        mail_.post(rank_, peer, host_copy(send, count));
      }
      if (receiving > 0) pending_.push_back({recv, receiving, peer});
      send += count;
      recv += receiving;
    }
  }
  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts) override {
    start_all_to_all(send, send_counts, recv, recv_counts);
    wait_started();
  }
  void wait_started() override {
    for (const Pending& p : pending_) {
      const std::vector<float> message = mail_.take(p.peer, rank_);
      if (int64_t(message.size()) != p.count) {
        throw std::logic_error("all_to_all: " + std::to_string(message.size()) + " floats from " +
                               std::to_string(p.peer) + ", " + std::to_string(p.count) +
                               " expected");
      }
      compute_.copy_from_host(p.data, message.data(), bytes(p.count));
    }
    pending_.clear();
  }

 private:
  static int64_t bytes(int64_t count) { return count * int64_t(sizeof(float)); }
  std::vector<float> host_copy(const float* data, int64_t count) {
    std::vector<float> values(static_cast<size_t>(count));
    compute_.copy_to_host(values.data(), data, bytes(count));
    return values;
  }
  // Every rank's `count` floats at `data`, in rank order.
  std::vector<std::vector<float>> gathered(const float* data, int64_t count) {
    std::vector<float> mine = host_copy(data, count);
    for (int64_t peer = 0; peer < size_; ++peer) {
      if (peer != rank_) mail_.post(rank_, peer, mine);
    }
    std::vector<std::vector<float>> parts;
    for (int64_t peer = 0; peer < size_; ++peer) {
      parts.push_back(peer == rank_ ? mine : mail_.take(peer, rank_));
    }
    return parts;
  }
  template <class Op>
  void combine(float* data, int64_t count, Op op) {
    const std::vector<std::vector<float>> parts = gathered(data, count);
    std::vector<float> result = parts[0];
    for (size_t r = 1; r < parts.size(); ++r) {
      for (size_t i = 0; i < result.size(); ++i) result[i] = op(result[i], parts[r][i]);
    }
    compute_.copy_from_host(data, result.data(), bytes(count));
  }

  struct Pending {
    float* data;
    int64_t count, peer;
  };
  Mailboxes& mail_;
  int64_t size_, rank_;
  Compute& compute_;
  std::vector<Pending> pending_;
};

inline std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(generator);
  return values;
}

// Rows of `full` [batch, seq_len, width] at each local row's position.
inline std::vector<float> local_rows(const std::vector<float>& full, const SequenceShard& shard,
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

// The compute a rank's thread computes on, made in that thread (null: the
// host's).
using ComputeMaker = std::function<std::shared_ptr<Compute>()>;

inline Buffer<float> on(Compute& compute, const std::vector<float>& values) {
  Buffer<float> buffer(values.size(), compute);
  compute.copy_from_host(buffer.data(), values.data(), int64_t(values.size() * sizeof(float)));
  return buffer;
}

inline std::vector<float> from(Compute& compute, const Buffer<float>& buffer) {
  std::vector<float> values(buffer.size());
  compute.copy_to_host(values.data(), buffer.data(), int64_t(values.size() * sizeof(float)));
  return values;
}

// Runs rank_call(rank, its compute, its group) for each of `ranks`
// threads, each on the compute `make` gives it; throws std::runtime_error
// naming the first rank whose call threw and what it threw (the others
// stop at their next wait for it).
template <class Rank>
void on_threads(int64_t ranks, const ComputeMaker& make, Rank&& rank_call) {
  Mailboxes mail;
  std::vector<std::thread> threads;
  std::mutex failed;
  std::string first_failure;
  for (int64_t rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        const std::shared_ptr<Compute> own = make ? make() : nullptr;
        Compute& compute = own ? *own : meshrun::models::host_compute();
        ThreadGroup group(mail, ranks, rank, compute);
        rank_call(rank, compute, group);
      } catch (const PeerFailed&) {
      } catch (const std::exception& error) {
        {
          std::lock_guard<std::mutex> lock(failed);
          if (first_failure.empty()) {
            first_failure = "rank " + std::to_string(rank) + ": " + error.what();
          }
        }
        mail.abandon();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (!first_failure.empty()) throw std::runtime_error(first_failure);
}

// Attention forward and backward of `full`'s sequences over cp = ring x
// ulysses threads, each given its rows of qkv and d_out.
inline RankResults over_cp_ranks(const AttentionShape& full, int64_t ring, int64_t ulysses,
                                 int64_t query_block, const std::vector<float>& qkv,
                                 const std::vector<float>& d_out, const ComputeMaker& make) {
  const int64_t cp = ring * ulysses;
  RankResults results{std::vector<std::vector<float>>(size_t(cp)),
                      std::vector<std::vector<float>>(size_t(cp))};
  on_threads(cp, make, [&](int64_t rank, Compute& compute, ThreadGroup& group) {
    AttentionShape local = full;
    local.seq_len = full.seq_len / cp;
    local.query_block = query_block;
    SequenceAttention attention(local, ContextParallel{&group, ring, ulysses}, "test", compute);
    const SequenceShard shard{cp, rank, full.seq_len};
    const Buffer<float> my_qkv = on(compute, local_rows(qkv, shard, full.batch, full.qkv_dim()));
    const Buffer<float> my_d_out = on(compute, local_rows(d_out, shard, full.batch, full.q_dim()));
    Buffer<float> my_out(my_d_out.size(), compute), my_lse(size_t(local.lse_size()), compute);
    Buffer<float> my_d_qkv(my_qkv.size(), compute);
    attention.forward(my_out.data(), my_lse.data(), my_qkv.data());
    attention.backward(my_d_qkv.data(), my_d_out.data(), my_qkv.data(), my_out.data(),
                       my_lse.data());
    results.out[size_t(rank)] = from(compute, my_out);
    results.d_qkv[size_t(rank)] = from(compute, my_d_qkv);
  });
  return results;
}

}  // namespace threaded_ranks
