// Multi-process test of a comm plugin (default: mpi), run by ctest under
// mpirun, e.g.
//
//   mpirun -np 4 meshrun-comm-ops-test --tp 2   # fsdp2 mesh dp_shard 2 x tp 2
//   mpirun -np 2 meshrun-comm-ops-test --pp 2   # two pipeline stages
//
// Every rank builds the mesh's communicators (every mesh and flattened axis,
// and the world) and checks every collective x dtype x communicator, at a
// size below and a size above the backend's shared-memory threshold, in
// place and out of place, against results it computes itself from the same
// deterministic per-rank inputs. Then: requests in flight on two axes at
// once, rings and chains of sends and receives, a wait that times out, and
// arguments the backend must refuse. Rank 0 prints one line per group of
// checks; a failing rank prints what failed. Exits 0 when every rank passed.
//
// Tolerance: none; 16-bit results must match exactly. Float inputs are
// multiples of 1/4 in [-31.75, 31.75] (at most 7 significant bits, exact in
// bfloat16, float16 and float32), so a float32 sum of up to 4 of them is
// exact, and dividing it by a power-of-two rank count is exact too. The
// backend accumulates 16-bit inputs in float32 and rounds once, so its
// result is the exact value rounded once to nearest even: the reference
// computes the exact value in double and rounds it once the same way. (With
// a rank count that is not a power of two the average would be rounded twice,
// to float32 and then to 16 bits, and could differ by one 16-bit ulp.)
// Across simulated nodes the hierarchical path rounds a node's partial sum to
// 16 bits before summing across nodes; a sum of two inputs has at most 8
// significant bits, exact in 16 bits, so the result is still rounded once.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "comm/bootstrap.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "mesh/mesh.hpp"
#include "meshrun/dtype.hpp"
#include "plugin/loader.hpp"

namespace {

using meshrun::Communicator;
using meshrun::FlatTensor;
using meshrun::ReduceOp;

struct DtypeCase {
  const char* name;
  DLDataType type;
  int significand_bits;  // 0: an integer type
};

const std::vector<DtypeCase>& dtypes() {
  static const std::vector<DtypeCase> cases = {
      {"float32", meshrun::dtype_float32(), 24}, {"bfloat16", meshrun::dtype_bfloat16(), 8},
      {"float16", meshrun::dtype_float16(), 11}, {"int32", meshrun::dtype_int32(), 0},
      {"int64", meshrun::dtype_int64(), 0},
  };
  return cases;
}

// The element counts every collective is checked at: below the mpi
// backend's 16 KiB shared-memory threshold for every dtype, and above it for
// every dtype; both divisible by every group size used (2, 3, 4).
// All_reduce takes any count: also a prime one, which no piece size of the
// backend divides. `--sizes small` (ctest's default; the full sweep takes
// `--sizes full`) still crosses every threshold and splits into several
// 64 KiB pieces and 12 KiB slots.
struct Sizes {
  std::vector<int64_t> every_op;
  std::vector<int64_t> all_reduce;
};
const Sizes kFullSizes = {{1200, 300000}, {1200, 300000, 100003}};
const Sizes kSmallSizes = {{1200, 30000}, {1200, 30000, 30011}};

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string text;
  for (const int64_t numel : sizes) text += (text.empty() ? "" : ", ") + std::to_string(numel);
  return text;
}

// A communicator and the world ranks of its members, in its rank order.
struct Group {
  std::string name;
  Communicator* comm;
  std::vector<int64_t> members;
};

// One check's parameters. `numel` is the size of the whole buffer: the
// all_reduce tensor, the all_gather recv, the reduce_scatter send.
struct Case {
  const Group& group;
  const DtypeCase& dtype;
  int64_t numel;
  bool in_place;
  int salt;  // varies the inputs from one check to the next

  int64_t ranks() const { return group.comm->size(); }
  int64_t rank() const { return group.comm->rank(); }
  std::string describe(const std::string& op) const {
    return op + " " + dtype.name + " n=" + std::to_string(numel) +
           (in_place ? " in place" : " out of place") + " on " + group.name;
  }
};

// Element i of the input of the group's rank q.
double input(const Case& c, int64_t q, int64_t i) {
  const int64_t world_rank = c.group.members[static_cast<size_t>(q)];
  const auto v = static_cast<double>((i * 7 + world_rank * 13 + c.salt * 5) % 255 - 127);
  if (c.dtype.significand_bits > 0) return v * 0.25;
  if (c.dtype.type.bits == 32) return v * 65537.0;
  return v * 8589934592.0 + static_cast<double>(world_rank);  // needs 64 bits
}

// `value` rounded to nearest even at `bits` significant bits (a normal
// number of the target type), independently of the backend's conversions.
double round_to(double value, int bits) {
  if (value == 0.0 || bits == 0) return value;
  int exponent = 0;
  const double mantissa = std::frexp(value, &exponent);
  return std::ldexp(std::nearbyint(std::ldexp(mantissa, bits)), exponent - bits);
}

// The expected element i of op over the group's inputs.
double reduced(const Case& c, ReduceOp op, int64_t i) {
  double result = input(c, 0, i);
  for (int64_t q = 1; q < c.ranks(); ++q) {
    const double value = input(c, q, i);
    result = op == ReduceOp::max ? std::max(result, value) : result + value;
  }
  if (op == ReduceOp::avg) {
    result = c.dtype.significand_bits > 0
                 ? result / static_cast<double>(c.ranks())
                 : static_cast<double>(static_cast<int64_t>(result) / c.ranks());
  }
  return round_to(result, c.dtype.significand_bits);
}

// A tensor's bytes, starting `shift` elements past a cache-line boundary:
// backends may take another path for line-aligned buffers than for others,
// and both must be right.
class Buffer {
 public:
  Buffer(DLDataType dtype, int64_t numel, int64_t shift = 0)
      : dtype_(dtype),
        storage_(static_cast<size_t>(numel + shift) * meshrun::dtype_bytes(dtype) + kLine) {
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + (kLine - address % kLine) % kLine +
            static_cast<size_t>(shift) * meshrun::dtype_bytes(dtype);
  }
  // A copy's storage would sit elsewhere against the lines; a move keeps it.
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&&) = default;
  Buffer& operator=(Buffer&&) = default;

  FlatTensor view(int64_t offset, int64_t numel) {
    return FlatTensor(data_ + offset * static_cast<int64_t>(meshrun::dtype_bytes(dtype_)), dtype_,
                      numel);
  }
  double at(int64_t i) const { return meshrun::load_element(data_, dtype_, i); }
  // Elements [first, first + count) = value(0 .. count - 1).
  void fill(int64_t first, int64_t count, const std::function<double(int64_t)>& value) {
    for (int64_t i = 0; i < count; ++i) {
      meshrun::store_element(data_, dtype_, first + i, value(i));
    }
  }

 private:
  static constexpr size_t kLine = 64;
  DLDataType dtype_;
  std::vector<std::byte> storage_;
  std::byte* data_;
};

class Checks {
 public:
  explicit Checks(int64_t world_rank) : world_rank_(world_rank) {}

  void fail(const std::string& what, const std::string& detail) {
    ++failures_;
    std::printf("[FAIL] rank %lld: %s: %s\n", static_cast<long long>(world_rank_), what.c_str(),
                detail.c_str());
    std::fflush(stdout);
  }
  // Compares elements [first, first + count) of `buffer` with expected(i).
  void compare(const std::string& what, const Buffer& buffer, int64_t first, int64_t count,
               const std::function<double(int64_t)>& expected) {
    for (int64_t i = 0; i < count; ++i) {
      const double want = expected(i);
      const double got = buffer.at(first + i);
      if (got != want) {
        fail(what, "element " + std::to_string(first + i) + " is " + std::to_string(got) +
                       ", expected " + std::to_string(want));
        return;
      }
    }
  }
  // Runs `body`, recording what it throws.
  void run(const std::string& what, const std::function<void()>& body) {
    try {
      body();
    } catch (const std::exception& e) {
      fail(what, e.what());
    }
  }
  int failures() const { return failures_; }

 private:
  int64_t world_rank_;
  int failures_ = 0;
};

// ---- collectives ----

// Every other dtype with line-aligned buffers, the others one element off.
void all_reduce(Checks& checks, const Case& c, ReduceOp op, const char* op_name) {
  const int64_t shift = c.salt % 2;
  const std::string what = c.describe(std::string("all_reduce(") + op_name + ")") +
                           (shift == 0 ? ", line-aligned" : ", one element off a line");
  Buffer send(c.dtype.type, c.numel, shift);
  Buffer recv(c.dtype.type, c.numel, shift);
  send.fill(0, c.numel, [&](int64_t i) { return input(c, c.rank(), i); });
  Buffer& out = c.in_place ? send : recv;
  FlatTensor in_view = send.view(0, c.numel);
  FlatTensor out_view = out.view(0, c.numel);
  checks.run(what, [&] { c.group.comm->all_reduce(in_view.get(), out_view.get(), op).wait(); });
  checks.compare(what, out, 0, c.numel, [&](int64_t i) { return reduced(c, op, i); });
}

// In place, the rank's input starts at the front of recv.
void all_gather(Checks& checks, const Case& c) {
  const std::string what = c.describe("all_gather");
  const int64_t chunk = c.numel / c.ranks();
  Buffer send(c.dtype.type, chunk);
  Buffer recv(c.dtype.type, c.numel);
  Buffer& in = c.in_place ? recv : send;
  in.fill(0, chunk, [&](int64_t i) { return input(c, c.rank(), i); });
  FlatTensor in_view = in.view(0, chunk);
  FlatTensor out_view = recv.view(0, c.numel);
  checks.run(what, [&] { c.group.comm->all_gather(in_view.get(), out_view.get()).wait(); });
  checks.compare(what, recv, 0, c.numel, [&](int64_t i) { return input(c, i / chunk, i % chunk); });
}

// In place, the result lands at the front of send.
void reduce_scatter(Checks& checks, const Case& c, ReduceOp op, const char* op_name) {
  const std::string what = c.describe(std::string("reduce_scatter(") + op_name + ")");
  const int64_t chunk = c.numel / c.ranks();
  Buffer send(c.dtype.type, c.numel);
  Buffer recv(c.dtype.type, chunk);
  send.fill(0, c.numel, [&](int64_t i) { return input(c, c.rank(), i); });
  Buffer& out = c.in_place ? send : recv;
  FlatTensor in_view = send.view(0, c.numel);
  FlatTensor out_view = out.view(0, chunk);
  checks.run(what, [&] { c.group.comm->reduce_scatter(in_view.get(), out_view.get(), op).wait(); });
  const int64_t first = c.rank() * chunk;
  checks.compare(what, out, 0, chunk, [&](int64_t i) { return reduced(c, op, first + i); });
}

// Always in place; the root varies with the salt.
void broadcast(Checks& checks, const Case& c) {
  const int64_t root = c.salt % c.ranks();
  const std::string what = c.describe("broadcast(root " + std::to_string(root) + ")");
  Buffer tensor(c.dtype.type, c.numel);
  tensor.fill(0, c.numel, [&](int64_t i) { return input(c, c.rank(), i); });
  FlatTensor view = tensor.view(0, c.numel);
  checks.run(what, [&] { c.group.comm->broadcast(view.get(), root).wait(); });
  checks.compare(what, tensor, 0, c.numel, [&](int64_t i) { return input(c, root, i); });
}

// Rank q sends rank r block_count(q, r) elements, from none to 3/4 of
// numel / ranks, varying with the pair and the salt; element j of that
// block is input(q, r * numel + j).
int64_t block_count(const Case& c, int64_t q, int64_t r) {
  return ((q * 3 + r * 5 + c.salt) % 4) * (c.numel / (4 * c.ranks()));
}

void all_to_all(Checks& checks, const Case& c) {
  const std::string what = c.describe("all_to_all");
  std::vector<int64_t> send_counts, recv_counts;
  int64_t sent = 0, received = 0;
  for (int64_t r = 0; r < c.ranks(); ++r) {
    send_counts.push_back(block_count(c, c.rank(), r));
    recv_counts.push_back(block_count(c, r, c.rank()));
    sent += send_counts.back();
    received += recv_counts.back();
  }
  Buffer send(c.dtype.type, std::max<int64_t>(sent, 1));
  Buffer recv(c.dtype.type, std::max<int64_t>(received, 1));
  int64_t at = 0;
  for (int64_t r = 0; r < c.ranks(); ++r) {
    send.fill(at, send_counts[size_t(r)],
              [&](int64_t j) { return input(c, c.rank(), r * c.numel + j); });
    at += send_counts[size_t(r)];
  }
  FlatTensor in_view = send.view(0, sent);
  FlatTensor out_view = recv.view(0, received);
  checks.run(what, [&] {
    c.group.comm->all_to_all(in_view.get(), send_counts, out_view.get(), recv_counts).wait();
  });
  at = 0;
  for (int64_t q = 0; q < c.ranks(); ++q) {
    checks.compare(what, recv, at, recv_counts[size_t(q)],
                   [&](int64_t i) { return input(c, q, c.rank() * c.numel + i); });
    at += recv_counts[size_t(q)];
  }
}

struct OpCase {
  const char* name;
  std::function<void(Checks&, const Case&)> run;
  bool has_in_place;
  bool any_count;  // checked at Sizes::all_reduce, not only Sizes::every_op
};

std::vector<OpCase> op_cases() {
  const auto reduce = [](auto check, ReduceOp op, const char* name) {
    return [check, op, name](Checks& checks, const Case& c) { check(checks, c, op, name); };
  };
  return {
      {"all_reduce(sum)", reduce(all_reduce, ReduceOp::sum, "sum"), true, true},
      {"all_reduce(avg)", reduce(all_reduce, ReduceOp::avg, "avg"), true, true},
      {"all_reduce(max)", reduce(all_reduce, ReduceOp::max, "max"), true, true},
      {"all_gather", all_gather, true, false},
      {"reduce_scatter(sum)", reduce(reduce_scatter, ReduceOp::sum, "sum"), true, false},
      {"reduce_scatter(avg)", reduce(reduce_scatter, ReduceOp::avg, "avg"), true, false},
      {"reduce_scatter(max)", reduce(reduce_scatter, ReduceOp::max, "max"), true, false},
      {"broadcast", broadcast, false, false},
      {"all_to_all", all_to_all, false, false},
  };
}

// Every rank's verdict: true when no rank failed since `failures_before`.
bool all_passed(Communicator& world, const Checks& checks, int failures_before) {
  int32_t failed = checks.failures() > failures_before ? 1 : 0;
  FlatTensor flag(&failed, meshrun::dtype_int32(), 1);
  world.all_reduce(flag.get(), ReduceOp::max).wait();
  return failed == 0;
}

void report(Communicator& world, const Checks& checks, int failures_before,
            const std::string& line) {
  const bool passed = all_passed(world, checks, failures_before);
  if (world.rank() == 0) {
    std::printf("[%s] %s\n", passed ? " ok " : "FAIL", line.c_str());
    std::fflush(stdout);
  }
}

void check_collectives(Checks& checks, Communicator& world, const std::vector<Group>& groups,
                       const Sizes& sizes) {
  int salt = 0;
  for (const Group& group : groups) {
    for (const OpCase& op : op_cases()) {
      const int before = checks.failures();
      const std::vector<int64_t>& counts = op.any_count ? sizes.all_reduce : sizes.every_op;
      for (const DtypeCase& dtype : dtypes()) {
        ++salt;
        for (const int64_t numel : counts) {
          for (const bool in_place : {false, true}) {
            if (in_place && !op.has_in_place) continue;
            op.run(checks, Case{group, dtype, numel, in_place, salt});
          }
        }
      }
      report(world, checks, before,
             std::string(op.name) + " on " + group.name + " (size " +
                 std::to_string(group.comm->size()) + "): 5 dtypes x n=" + sizes_text(counts) +
                 (op.has_in_place ? " x in/out of place" : ""));
    }
  }
}

// ---- requests in flight, transfers, timeouts, refusals ----

// all_reduces on two axes in flight at once while this thread computes,
// then waited for in the reverse order of starting them.
void check_overlap(Checks& checks, Group& first, Group& second) {
  constexpr int64_t kNumel = 1 << 20;
  const DtypeCase& f32 = dtypes()[0];
  const Case a{first, f32, kNumel, true, 101};
  const Case b{second, f32, kNumel, true, 102};
  Buffer a_data(f32.type, kNumel);
  Buffer b_data(f32.type, kNumel);
  a_data.fill(0, kNumel, [&](int64_t i) { return input(a, a.rank(), i); });
  b_data.fill(0, kNumel, [&](int64_t i) { return input(b, b.rank(), i); });
  FlatTensor a_view = a_data.view(0, kNumel);
  FlatTensor b_view = b_data.view(0, kNumel);
  const std::string what = "overlapping all_reduces on " + first.name + " and " + second.name;
  checks.run(what, [&] {
    meshrun::Request on_first = first.comm->all_reduce(a_view.get(), ReduceOp::sum);
    meshrun::Request on_second = second.comm->all_reduce(b_view.get(), ReduceOp::sum);
    // Computing while they proceed: both must finish without a wait.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    double work = 0.0;
    while (!(on_first.test() && on_second.test())) {
      for (int i = 0; i < 10000; ++i) work += std::sqrt(static_cast<double>(i) + work);
      if (std::chrono::steady_clock::now() > deadline) {
        checks.fail(what, "did not complete while the caller computed");
        break;
      }
    }
    on_second.wait();
    on_first.wait();
  });
  checks.compare(what, a_data, 0, kNumel, [&](int64_t i) { return reduced(a, ReduceOp::sum, i); });
  checks.compare(what, b_data, 0, kNumel, [&](int64_t i) { return reduced(b, ReduceOp::sum, i); });
}

// Every rank sends to the next and receives from the previous at once, two
// large messages each way with different tags, posted in opposite orders
// on the two sides; a blocking pair of transfers would deadlock here.
void check_ring(Checks& checks, Group& group) {
  constexpr int64_t kNumel = 3 << 20;  // 12 MiB of float32: no eager sends
  const DtypeCase& f32 = dtypes()[0];
  const int64_t ranks = group.comm->size();
  const int64_t next = (group.comm->rank() + 1) % ranks;
  const int64_t previous = (group.comm->rank() + ranks - 1) % ranks;
  const Case mine{group, f32, kNumel, false, 201};
  const std::string what = "ring of sends and receives on " + group.name;
  std::vector<Buffer> out;
  std::vector<Buffer> in;
  for (int tag = 0; tag < 2; ++tag) {
    out.emplace_back(f32.type, kNumel);
    in.emplace_back(f32.type, kNumel);
  }
  for (int tag = 0; tag < 2; ++tag) {
    out[tag].fill(0, kNumel, [&](int64_t i) { return input(mine, mine.rank(), i + tag); });
  }
  checks.run(what, [&] {
    FlatTensor send0 = out[0].view(0, kNumel), send1 = out[1].view(0, kNumel);
    FlatTensor recv0 = in[0].view(0, kNumel), recv1 = in[1].view(0, kNumel);
    meshrun::Request sent1 = group.comm->send(send1.get(), next, 1);
    meshrun::Request sent0 = group.comm->send(send0.get(), next, 0);
    meshrun::Request got0 = group.comm->recv(recv0.get(), previous, 0);
    meshrun::Request got1 = group.comm->recv(recv1.get(), previous, 1);
    sent1.wait();
    sent0.wait();
    got0.wait();
    got1.wait();
  });
  for (int tag = 0; tag < 2; ++tag) {
    checks.compare(what + " (tag " + std::to_string(tag) + ")", in[tag], 0, kNumel,
                   [&](int64_t i) { return input(mine, previous, i + tag); });
  }
}

// A pipeline's forward then backward chain: rank 0 starts, each rank adds
// one to what it receives and passes it on, the last sends it back.
void check_chain(Checks& checks, Group& group) {
  constexpr int64_t kNumel = 1 << 20;
  const int64_t rank = group.comm->rank();
  const int64_t last = group.comm->size() - 1;
  std::vector<int32_t> data(kNumel, 0);
  FlatTensor view(data.data(), meshrun::dtype_int32(), kNumel);
  const std::string what = "forward and backward chain on " + group.name;
  checks.run(what, [&] {
    if (rank > 0) group.comm->recv(view.get(), rank - 1, 7).wait();
    for (int32_t& value : data) value += 1;
    if (rank < last) {
      group.comm->send(view.get(), rank + 1, 7).wait();
      group.comm->recv(view.get(), rank + 1, 8).wait();
    }
    if (rank > 0) group.comm->send(view.get(), rank - 1, 8).wait();
  });
  const auto expected = static_cast<int32_t>(last + 1);
  if (data.front() != expected || data.back() != expected) {
    checks.fail(what, "rank 0's data came back as " + std::to_string(data.front()) + ", expected " +
                          std::to_string(expected));
  }
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Rank 0 waits briefly for a message rank 1 has not sent: DEADLINE_EXCEEDED
// naming the operation, and the request stays usable. Then rank 1 sends it
// and the run goes on.
void check_timeout(Checks& checks, Communicator& world) {
  const std::string what = "wait timeout on world";
  int32_t value = 0;
  FlatTensor view(&value, meshrun::dtype_int32(), 1);
  if (world.rank() == 0) {
    meshrun::Request late = world.recv(view.get(), 1, 99);
    try {
      late.wait(0.3);
      checks.fail(what, "the wait returned although nothing was sent");
    } catch (const meshrun::Error& e) {
      const std::string message = e.what();
      const bool named = contains(message, "recv") && contains(message, "'world'") &&
                         contains(message, "size " + std::to_string(world.size())) &&
                         contains(message, "world rank 0") && contains(message, "0.3");
      if (e.code() != MESHRUN_DEADLINE_EXCEEDED || !named) checks.fail(what, message);
    }
    if (late.test()) checks.fail(what, "test() says done before the send");
    world.barrier().wait();
    checks.run(what, [&] { late.wait(); });
    if (value != 42) checks.fail(what, "received " + std::to_string(value) + ", expected 42");
  } else {
    world.barrier().wait();
    value = 42;
    if (world.rank() == 1) checks.run(what, [&] { world.send(view.get(), 0, 99).wait(); });
  }
}

// Expects `body` to throw INVALID_ARGUMENT whose message contains `part`.
void expect_invalid(Checks& checks, const std::string& what, const std::string& part,
                    const std::function<void()>& body) {
  try {
    body();
    checks.fail(what, "was accepted");
  } catch (const meshrun::Error& e) {
    if (e.code() != MESHRUN_INVALID_ARGUMENT || !contains(e.what(), part)) {
      checks.fail(what, std::string("wrong error: ") + e.what());
    }
  }
}

// Refused on the calling rank alone, before anything reaches MPI.
// The bootstrap a backend like nccl starts from: rank `root`'s bytes (a
// length no whole number of words, as NCCL's 128-byte id plus 3) reach
// every rank unchanged, and a rank's own bytes are overwritten.
void check_bootstrap(Checks& checks, Communicator& world) {
  const meshrun::CommBootstrap bootstrap(world);
  const meshrun_bootstrap& b = *bootstrap.get();
  if (b.rank != world.rank() || b.size != world.size()) {
    checks.fail("bootstrap", "its rank and size are not the world's");
  }
  const int64_t root = world.size() - 1;
  const auto byte_of = [](int64_t rank, size_t i) { return uint8_t(rank * 31 + int64_t(i) * 7); };
  std::vector<uint8_t> bytes(131);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = byte_of(world.rank(), i);
  if (meshrun_error* error = b.broadcast(b.context, bytes.data(), bytes.size(), root)) {
    checks.fail("bootstrap", error->message);
    error->destroy(error);
    return;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != byte_of(root, i)) {
      checks.fail("bootstrap",
                  "byte " + std::to_string(i) + " is not rank " + std::to_string(root) + "'s");
      return;
    }
  }
}

void check_refusals(Checks& checks, Group& group) {
  std::vector<float> data(8, 0.0f);
  std::vector<float> half(4, 0.0f);
  FlatTensor tensor(data.data(), meshrun::dtype_float32(), 8);
  FlatTensor smaller(half.data(), meshrun::dtype_float32(), 4);
  FlatTensor bytes(data.data(), DLDataType{kDLInt, 8, 1}, 8);
  FlatTensor on_gpu(data.data(), meshrun::dtype_float32(), 8, DLDevice{kDLCUDA, 0});
  const std::string where = "on communicator '" + group.name + "'";
  Communicator& comm = *group.comm;
  expect_invalid(checks, "int8 all_reduce", "all_reduce " + where,
                 [&] { comm.all_reduce(bytes.get(), ReduceOp::sum).wait(); });
  expect_invalid(checks, "all_reduce of unequal sizes", "numel(recv) = numel(send)",
                 [&] { comm.all_reduce(tensor.get(), smaller.get(), ReduceOp::sum).wait(); });
  expect_invalid(checks, "reduce op 7", "reduce op 7",
                 [&] { comm.all_reduce(tensor.get(), static_cast<ReduceOp>(7)).wait(); });
  expect_invalid(checks, "CUDA tensor", "kDLCPU", [&] { comm.broadcast(on_gpu.get(), 0).wait(); });
  expect_invalid(checks, "broadcast root out of range", "root",
                 [&] { comm.broadcast(tensor.get(), comm.size()).wait(); });
  expect_invalid(checks, "negative tag", "tag", [&] { comm.send(tensor.get(), 0, -1).wait(); });
  expect_invalid(checks, "all_gather of the wrong size", "numel(recv) = size * numel(send)",
                 [&] { comm.all_gather(tensor.get(), smaller.get()).wait(); });
}

struct Options {
  meshrun::ParallelismSizes sizes;
  std::string plugin = "mpi";
  Sizes sizes_checked = kFullSizes;
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--plugin") {
      options.plugin = value;
    } else if (flag == "--pp") {
      options.sizes.pp_size = std::stoll(value);
    } else if (flag == "--tp") {
      options.sizes.tp_size = std::stoll(value);
    } else if (flag == "--sizes" && (value == "full" || value == "small")) {
      options.sizes_checked = value == "full" ? kFullSizes : kSmallSizes;
    } else {
      throw meshrun::invalid_argument("unknown option " + flag + " " + value +
                                      " (--plugin, --pp, --tp, --sizes full|small)");
    }
  }
  return options;
}

int run(const Options& options) {
  meshrun::CommBackend backend(meshrun::PluginLoader::from_environment(), options.plugin);
  Communicator world = backend.world(120.0);
  const meshrun::MeshContext mesh =
      meshrun::resolve_mesh(options.sizes, world.size(), meshrun::MeshFamily::fsdp2);
  meshrun::MeshCommunicators axes(world, mesh);
  std::vector<meshrun::Axis> axis_list(meshrun::kMeshAxes.begin(), meshrun::kMeshAxes.end());
  axis_list.insert(axis_list.end(), meshrun::kFlattenedAxes.begin(), meshrun::kFlattenedAxes.end());
  std::vector<Group> groups;
  for (const meshrun::Axis axis : axis_list) {
    groups.push_back({std::string(meshrun::axis_name(axis)), &axes.axis(axis),
                      mesh.group_ranks(axis, world.rank())});
  }
  std::vector<int64_t> everyone(static_cast<size_t>(world.size()));
  for (size_t r = 0; r < everyone.size(); ++r) everyone[r] = static_cast<int64_t>(r);
  groups.push_back({"world", &world, everyone});

  Checks checks(world.rank());
  check_collectives(checks, world, groups, options.sizes_checked);
  std::vector<Group*> shared;  // groups of more than one rank, the world last
  for (Group& group : groups) {
    if (group.comm->size() > 1) shared.push_back(&group);
  }
  if (shared.size() >= 2) {
    const int before = checks.failures();
    check_overlap(checks, *shared[0], *shared[1]);
    report(world, checks, before,
           "all_reduces in flight on " + shared[0]->name + " and " + shared[1]->name +
               " while computing, waited in reverse order");
  }
  for (Group* group : shared) {
    const int before = checks.failures();
    check_ring(checks, *group);
    check_chain(checks, *group);
    report(world, checks, before,
           "ring and forward/backward chain of sends and receives on " + group->name);
  }
  if (world.size() > 1) {
    const int before = checks.failures();
    check_timeout(checks, world);
    report(world, checks, before, "a wait for an unsent message times out, then completes");
  }
  {
    const int before = checks.failures();
    check_bootstrap(checks, world);
    report(world, checks, before, "a bootstrap over the world carries the root's bytes");
  }
  const int before = checks.failures();
  check_refusals(checks, groups.front());
  report(world, checks, before, "invalid arguments refused with INVALID_ARGUMENT");
  return all_passed(world, checks, 0) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm ops test: %s\n", e.what());
    return 2;
  }
}
