#include "unit_comm.hpp"

#include <cstddef>

#include "common/errors.hpp"

namespace meshrun::sharding {
namespace {

using strategies::throw_if_error;

size_t bytes_of(int64_t numel, Dtype dtype) {
  return static_cast<size_t>(numel) * dtype_bytes(dtype);
}

}  // namespace

Gather::Gather(const Groups& groups, const CommPlace& comm, const float* local, Dtype dtype,
               MemoryMeter& meter, Buffer* slot)
    : device_(&meter.device()),
      block_(comm.block),
      dtype_(dtype),
      what_("all_gather of " + comm.name),
      send_numel_(block_->chunk),
      recv_numel_(block_->padded_numel),
      send_(meter),
      recv_(meter),
      full_(meter),
      received_(meter) {
  recv_.allocate(bytes_of(recv_numel_, dtype), false);
  // In float32 the chunk goes straight from the shard, which nothing
  // writes while a step gathers; another dtype needs it cast first.
  void* chunk = const_cast<float*>(local + block_->local_begin);
  if (dtype != Dtype::float32) {
    send_.allocate(bytes_of(send_numel_, dtype), false);
    device_->narrow(dtype, local + block_->local_begin, send_.data(), send_numel_, 1.0f);
    chunk = send_.data();
  }
  const DLTensor send = flat_tensor(chunk, device_->where(), dtype, send_numel_);
  DLTensor recv = flat_tensor(recv_.data(), device_->where(), dtype, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups.comm->all_gather(groups.shard, &send, &recv, &request), what_);
  request_ = strategies::Request(*groups.comm, request);
  if (device_->orders_work_after_collectives()) {
    if (slot != nullptr) full_.swap(*slot);
    unpack(full_, received_);
    ready_ = device_->record();
    full_.used_until(ready_);
    received_.used_until(ready_);
    release_buffers();
  }
}

bool Gather::done() { return request_.test(what_); }

strategies::Request Gather::finish(Buffer& full, Buffer& received) {
  if (device_->orders_work_after_collectives()) {
    full.swap(full_);
    received.swap(received_);
    return std::move(request_);
  }
  request_.wait(what_);
  unpack(full, received);
  release_buffers();
  return {};
}

void Gather::unpack(Buffer& full, Buffer& received) {
  if (dtype_ == Dtype::float32 && !full.held()) {
    full.swap(recv_);
  } else {
    full.ensure(bytes_of(block_->full_numel, Dtype::float32));
    device_->widen(dtype_, recv_.data(), full.floats(), block_->full_numel);
  }
  if (dtype_ == Dtype::bfloat16) received.swap(recv_);
}

void Gather::release_buffers() {
  send_.used_until(ready_);
  recv_.used_until(ready_);
  send_.release();
  recv_.release();
}

Reduction::Reduction(const Groups& groups, const CommPlace& comm, Buffer& gradients, Dtype dtype,
                     int32_t op, float scale, float* local_gradients, MemoryMeter& meter)
    : device_(&meter.device()),
      groups_(&groups),
      block_(comm.block),
      dtype_(dtype),
      op_(op),
      unit_name_(comm.name),
      replicated_(groups.replicate_size == 1),
      what_("reduce_scatter of the gradients of " + unit_name_),
      send_numel_(block_->padded_numel),
      recv_numel_(block_->chunk),
      local_gradients_(local_gradients),
      send_(meter),
      recv_(meter) {
  // A shard group of one (ZeRO-0) has nothing to scatter: the gradients go
  // straight to the all-reduce over the replicas.
  if (comm.ranks == 1 && !replicated_) {
    cast_into(gradients, recv_, recv_numel_, scale);
    start_all_reduce();
    return;
  }
  cast_into(gradients, send_, send_numel_, scale);
  recv_.allocate(bytes_of(recv_numel_, dtype), false);
  const DLTensor send = flat_tensor(send_.data(), device_->where(), dtype, send_numel_);
  DLTensor recv = flat_tensor(recv_.data(), device_->where(), dtype, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups.comm->reduce_scatter(groups.shard, &send, &recv, op_, &request), what_);
  request_ = strategies::Request(*groups.comm, request);
  if (replicated_) enqueue_add();
}

// float32 gradients are scaled where they are and handed over; another
// dtype gets a buffer of its own.
void Reduction::cast_into(Buffer& gradients, Buffer& into, int64_t numel, float scale) {
  if (dtype_ != Dtype::float32) {
    into.allocate(bytes_of(numel, dtype_), false);
    device_->narrow(dtype_, gradients.floats(), into.data(), numel, scale);
    return;
  }
  into.swap(gradients);
  if (scale != 1.0f) device_->narrow(Dtype::float32, into.floats(), into.data(), numel, scale);
}

bool Reduction::awaits_replication() const { return !replicated_; }

void Reduction::replicate() {
  if (device_->orders_work_after_collectives()) {
    scattered_ = std::move(request_);
  } else {
    request_.wait(what_);
    send_.release();
  }
  start_all_reduce();
}

void Reduction::start_all_reduce() {
  what_ = "all_reduce over the replicate group of the gradients of " + unit_name_;
  DLTensor result = flat_tensor(recv_.data(), device_->where(), dtype_, recv_numel_);
  meshrun_request* request = nullptr;
  throw_if_error(groups_->comm->all_reduce(groups_->replicate, &result, &result, op_, &request),
                 what_);
  request_ = strategies::Request(*groups_->comm, request);
  replicated_ = true;
  enqueue_add();
}

void Reduction::enqueue_add() {
  if (!device_->orders_work_after_collectives()) return;
  device_->widen_add(dtype_, recv_.data(), local_gradients_ + block_->local_begin, recv_numel_);
  const EventRef added = device_->record();
  send_.used_until(added);
  recv_.used_until(added);
}

bool Reduction::done() { return replicated_ && request_.test(what_); }

void Reduction::finish() {
  scattered_.wait("reduce_scatter of the gradients of " + unit_name_);
  request_.wait(what_);
  if (!device_->orders_work_after_collectives()) {
    device_->widen_add(dtype_, recv_.data(), local_gradients_ + block_->local_begin, recv_numel_);
  }
  release_buffers();
}

void Reduction::release_buffers() {
  send_.release();
  recv_.release();
}

}  // namespace meshrun::sharding
