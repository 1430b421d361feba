#include "dtype.hpp"

#include <cstring>
#include <type_traits>

#include "meshrun/dtype.hpp"
#include "nontemporal.hpp"

namespace meshrun::mpi {
namespace {

// How a stored element widens to its accumulator and narrows back.
template <class Stored>
struct Native {
  using Storage = Stored;
  using Acc = Stored;
  static Acc widen(Storage value) { return value; }
  static Storage narrow(Acc value) { return value; }
};

// Round to nearest even (meshrun/dtype.hpp, shared with the tests' and
// benchmarks' references).
struct BFloat16 {
  using Storage = uint16_t;
  using Acc = float;
  static Acc widen(Storage value) { return meshrun::bfloat16_to_float(value); }
  static Storage narrow(Acc value) { return meshrun::float_to_bfloat16(value); }
};

// IEEE binary16, round to nearest even (meshrun/dtype.hpp).
struct Float16 {
  using Storage = uint16_t;
  using Acc = float;
  static Acc widen(Storage value) { return meshrun::float16_to_float(value); }
  static Storage narrow(Acc value) { return meshrun::float_to_float16(value); }
};

// Calls `body` with the element description of `dtype`.
template <class Body>
decltype(auto) with_element(Dtype dtype, Body&& body) {
  switch (dtype) {
    case Dtype::bfloat16:
      return body(BFloat16{});
    case Dtype::float16:
      return body(Float16{});
    case Dtype::int32:
      return body(Native<int32_t>{});
    case Dtype::int64:
      return body(Native<int64_t>{});
    case Dtype::float32:
      break;
  }
  return body(Native<float>{});
}

// Integer sums wrap instead of overflowing into undefined behaviour.
template <class T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <class T>
T larger(T a, T b) {
  return a < b ? b : a;
}

struct Add {
  template <class T>
  T operator()(T a, T b) const {
    return add(a, b);
  }
};

struct Larger {
  template <class T>
  T operator()(T a, T b) const {
    return larger(a, b);
  }
};

// Calls `body` with the binary function of `op` (AVG sums).
template <class Body>
void with_combiner(ReduceOp op, Body&& body) {
  if (op == ReduceOp::max) {
    body(Larger{});
  } else {
    body(Add{});
  }
}

// Writes value(i) for i < count into results.dst, and into results.copy
// when there is one. Streamed copies are built a cache line at a time in a
// local line, then stored to dst and streamed to the copy: in one loop with
// the reduction the non-temporal stores overlap its loads (a separate
// streaming pass, or one per 4 KiB block, ran 8-20% slower on 2 ranks here).
// Each line is read before it is written, so dst may alias the inputs.
template <class Storage, class Value>
void write_results(const Results& results, size_t count, Value value) {
  auto* dst = static_cast<Storage*>(results.dst);
  auto* copy = static_cast<Storage*>(results.copy);
  if (copy == nullptr) {
    for (size_t i = 0; i < count; ++i) dst[i] = value(i);
    return;
  }
  size_t i = 0;
  if (results.stream) {
    constexpr size_t per_line = kLineBytes / sizeof(Storage);
    for (; i < count && !line_aligned(copy + i); ++i) dst[i] = copy[i] = value(i);
    for (; i + per_line <= count; i += per_line) {
      alignas(kLineBytes) Storage line[per_line];
      for (size_t k = 0; k < per_line; ++k) line[k] = value(i + k);
      std::memcpy(dst + i, line, kLineBytes);
      stream_line(copy + i, line);
    }
  }
  for (; i < count; ++i) dst[i] = copy[i] = value(i);
}

// reduce_two_lines() for one element type, operation and kind of store.
// Every pointer is a parameter, so none is reloaded after the stores, which
// may alias anything: a general loop over descriptors of the copies, reloaded
// on every line, ran no faster than three separate loops. A line's results
// are built in a local array of fixed length, which the compiler keeps in a
// vector register.
template <class E, bool kAverage, bool kStream, class Combiner>
void reduce_two_lines_of(Combiner combiner, const void* own, const void* input,
                         const Results& results, size_t lines, const LineCopy& in,
                         const LineCopy& out) {
  using Storage = typename E::Storage;
  using Acc = typename E::Acc;
  constexpr size_t per_line = kLineBytes / sizeof(Storage);
  const auto* mine = static_cast<const Storage*>(own);
  const auto* theirs = static_cast<const Storage*>(input);
  auto* dst = static_cast<Storage*>(results.dst);
  auto* copy = static_cast<Storage*>(results.copy);
  auto* in_dst = static_cast<std::byte*>(in.dst);
  const auto* in_src = static_cast<const std::byte*>(in.src);
  auto* out_dst = static_cast<std::byte*>(out.dst);
  const auto* out_src = static_cast<const std::byte*>(out.src);
  const auto store_line = [](void* to, const void* from) {
    if constexpr (kStream) {
      stream_line(to, from);
    } else {
      std::memcpy(to, from, kLineBytes);
    }
  };
  for (size_t line = 0; line < lines; ++line) {
    const size_t first = line * per_line;
    alignas(kLineBytes) Storage result[per_line];
    for (size_t k = 0; k < per_line; ++k) {
      const Acc sum = combiner(E::widen(mine[first + k]), E::widen(theirs[first + k]));
      result[k] = E::narrow(kAverage ? static_cast<Acc>(sum / Acc{2}) : sum);
    }
    std::memcpy(dst + first, result, kLineBytes);
    store_line(copy + first, result);
    std::memcpy(in_dst + line * kLineBytes, in_src + line * kLineBytes, kLineBytes);
    store_line(out_dst + line * kLineBytes, out_src + line * kLineBytes);
  }
}

}  // namespace

size_t element_bytes(Dtype dtype) {
  return with_element(dtype, []<class E>(E) { return sizeof(typename E::Storage); });
}

size_t accumulator_bytes(Dtype dtype) {
  return with_element(dtype, []<class E>(E) { return sizeof(typename E::Acc); });
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::bfloat16:
      return "bfloat16";
    case Dtype::float16:
      return "float16";
    case Dtype::int32:
      return "int32";
    case Dtype::int64:
      return "int64";
    case Dtype::float32:
      break;
  }
  return "float32";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::sum:
      break;
  }
  return "sum";
}

void combine(Dtype dtype, ReduceOp op, const void* a, const void* b, void* acc, size_t count) {
  with_element(dtype, [&]<class E>(E) {
    const auto* first = static_cast<const typename E::Storage*>(a);
    const auto* second = static_cast<const typename E::Storage*>(b);
    auto* out = static_cast<typename E::Acc*>(acc);
    if (second == nullptr) {
      for (size_t i = 0; i < count; ++i) out[i] = E::widen(first[i]);
      return;
    }
    with_combiner(op, [&](auto combiner) {
      for (size_t i = 0; i < count; ++i) out[i] = combiner(E::widen(first[i]), E::widen(second[i]));
    });
  });
}

void accumulate(Dtype dtype, ReduceOp op, void* acc, const void* src, size_t count) {
  with_element(dtype, [&]<class E>(E) {
    const auto* in = static_cast<const typename E::Storage*>(src);
    auto* inout = static_cast<typename E::Acc*>(acc);
    with_combiner(op, [&](auto combiner) {
      for (size_t i = 0; i < count; ++i) inout[i] = combiner(inout[i], E::widen(in[i]));
    });
  });
}

void finish(Dtype dtype, ReduceOp op, int64_t ranks, const void* acc, const void* last,
            const Results& results, size_t count) {
  with_element(dtype, [&]<class E>(E) {
    using Acc = typename E::Acc;
    using Storage = typename E::Storage;
    const auto* in = static_cast<const Acc*>(acc);
    const auto* tail = static_cast<const Storage*>(last);
    const auto divisor = static_cast<Acc>(ranks);
    const bool average = op == ReduceOp::avg;
    with_combiner(op, [&](auto combiner) {
      const auto write = [&](auto value) { write_results<Storage>(results, count, value); };
      if (tail != nullptr && average) {
        write([&](size_t i) { return E::narrow(combiner(in[i], E::widen(tail[i])) / divisor); });
      } else if (tail != nullptr) {
        write([&](size_t i) { return E::narrow(combiner(in[i], E::widen(tail[i]))); });
      } else if (average) {
        write([&](size_t i) { return E::narrow(in[i] / divisor); });
      } else if (acc != results.dst || results.copy != nullptr) {
        write([&](size_t i) { return E::narrow(in[i]); });
      }
    });
  });
}

void reduce(Dtype dtype, ReduceOp op, int ranks, const void* own,
            const std::function<const void*(int)>& next, void* acc, const Results& results,
            size_t count) {
  const bool native = accumulator_bytes(dtype) == element_bytes(dtype);
  const void* so_far = own;
  for (int step = 1; step < ranks; ++step) {
    const void* incoming = next(step);
    if (step == ranks - 1 && (native || so_far == acc)) {
      finish(dtype, op, ranks, so_far, incoming, results, count);
      return;
    }
    if (so_far == own) {
      combine(dtype, op, own, incoming, acc, count);
    } else {
      accumulate(dtype, op, acc, incoming, count);
    }
    so_far = acc;
  }
  if (so_far == own) combine(dtype, op, own, nullptr, acc, count);
  finish(dtype, op, ranks, acc, nullptr, results, count);
}

void reduce_two_lines(Dtype dtype, ReduceOp op, const void* own, const void* input,
                      const Results& results, size_t lines, const LineCopy& copy_in,
                      const LineCopy& copy_out) {
  with_element(dtype, [&]<class E>(E) {
    with_combiner(op, [&](auto combiner) {
      const auto run = [&]<bool kAverage, bool kStream>() {
        reduce_two_lines_of<E, kAverage, kStream>(combiner, own, input, results, lines, copy_in,
                                                  copy_out);
      };
      const bool average = op == ReduceOp::avg;
      if (average && results.stream) {
        run.template operator()<true, true>();
      } else if (average) {
        run.template operator()<true, false>();
      } else if (results.stream) {
        run.template operator()<false, true>();
      } else {
        run.template operator()<false, false>();
      }
    });
  });
}

}  // namespace meshrun::mpi
