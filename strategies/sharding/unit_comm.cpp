#include "unit_comm.hpp"

#include <cstddef>

#include "common/errors.hpp"

namespace meshrun::sharding {
namespace {

using strategies::throw_if_error;

// Elements of `dtype` at element `offset` of `buffer`.
std::byte* at(const Buffer& buffer, Dtype dtype, int64_t offset) {
  return buffer.data() + static_cast<size_t>(offset) * dtype_bytes(dtype);
}

size_t bytes_of(int64_t numel, Dtype dtype) {
  return static_cast<size_t>(numel) * dtype_bytes(dtype);
}

}  // namespace

Gather::Gather(const Groups& groups, const CommPlace& comm, const float* local, Dtype dtype,
               MemoryMeter& meter)
    : unit_(comm.unit),
      ranks_(comm.ranks),
      dtype_(dtype),
      what_("all_gather of " + comm.name),
      send_numel_(unit_->block_numel),
      recv_numel_(ranks_ * unit_->block_numel),
      send_(meter),
      recv_(meter) {
  recv_.allocate(bytes_of(recv_numel_, dtype), false);
  // In float32 the block goes straight from the shard, which nothing
  // writes while a step gathers; another dtype needs it cast first.
  void* block = const_cast<float*>(local + unit_->local_begin);
  if (dtype != Dtype::float32) {
    send_.allocate(bytes_of(send_numel_, dtype), false);
    narrow(dtype, local + unit_->local_begin, send_.data(), send_numel_);
    block = send_.data();
  }
  const DLTensor send = host_tensor(block, dtype, send_numel_);
  DLTensor recv = host_tensor(recv_.data(), dtype, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups.comm->all_gather(groups.shard, &send, &recv, &request), what_);
  request_ = strategies::Request(*groups.comm, request);
}

bool Gather::done() { return request_.test(what_); }

void Gather::finish(Buffer& full) {
  request_.wait(what_);
  full.ensure(static_cast<size_t>(unit_->full_numel) * sizeof(float));
  for (const ParameterPlace& place : unit_->parameters) {
    for (int64_t r = 0; r < ranks_; ++r) {
      widen(dtype_, at(recv_, dtype_, r * unit_->block_numel + place.block_begin),
            full.floats() + place.unit_begin + r * place.chunk, place.filled(r));
    }
  }
  send_.release();
  recv_.release();
}

Reduction::Reduction(const Groups& groups, const CommPlace& comm, const float* gradients,
                     Dtype dtype, int32_t op, float scale, MemoryMeter& meter)
    : groups_(&groups),
      unit_(comm.unit),
      dtype_(dtype),
      op_(op),
      unit_name_(comm.name),
      replicated_(groups.replicate_size == 1),
      what_("reduce_scatter of the gradients of " + unit_name_),
      send_numel_(comm.ranks * unit_->block_numel),
      recv_numel_(unit_->block_numel),
      send_(meter),
      recv_(meter) {
  if (comm.ranks == 1 && !replicated_) {
    start_replicated_only(gradients, scale);
    return;
  }
  send_.allocate(bytes_of(send_numel_, dtype), true);
  recv_.allocate(bytes_of(recv_numel_, dtype), false);
  for (const ParameterPlace& place : unit_->parameters) {
    for (int64_t r = 0; r < comm.ranks; ++r) {
      narrow(dtype, gradients + place.unit_begin + r * place.chunk,
             at(send_, dtype, r * unit_->block_numel + place.block_begin), place.filled(r), scale);
    }
  }
  const DLTensor send = host_tensor(send_.data(), dtype, send_numel_);
  DLTensor recv = host_tensor(recv_.data(), dtype, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups.comm->reduce_scatter(groups.shard, &send, &recv, op_, &request), what_);
  request_ = strategies::Request(*groups.comm, request);
}

// A shard group of one (ZeRO-0) has nothing to scatter: the gradients go
// straight to the all-reduce over the replicas.
void Reduction::start_replicated_only(const float* gradients, float scale) {
  recv_.allocate(bytes_of(recv_numel_, dtype_), true);
  for (const ParameterPlace& place : unit_->parameters) {
    narrow(dtype_, gradients + place.unit_begin, at(recv_, dtype_, place.block_begin),
           place.filled(0), scale);
  }
  start_all_reduce();
}

bool Reduction::awaits_replication() const { return !replicated_; }

void Reduction::replicate() {
  request_.wait(what_);
  send_.release();
  start_all_reduce();
}

void Reduction::start_all_reduce() {
  what_ = "all_reduce over the replicate group of the gradients of " + unit_name_;
  DLTensor result = host_tensor(recv_.data(), dtype_, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups_->comm->all_reduce(groups_->replicate, &result, &result, op_, &request),
                 what_);
  request_ = strategies::Request(*groups_->comm, request);
  replicated_ = true;
}

bool Reduction::done() { return replicated_ && request_.test(what_); }

void Reduction::finish(float* local_gradients) {
  request_.wait(what_);
  widen_add(dtype_, recv_.data(), local_gradients + unit_->local_begin, recv_numel_);
  send_.release();
  recv_.release();
}

}  // namespace meshrun::sharding
