// Collectives of moecore::parallel::ProcessGroup checked against single-process computations: every rank builds
// deterministic inputs from its rank, and computes the expected result locally from all ranks' inputs.
// Every result test runs twice: with agreement checks off (the default; the environment must not set
// MOECORE_CHECK_COLLECTIVES) and on (set_agreement_checks); the tests of ranks that disagree run with checks on.
// With --env-checks the environment must set MOECORE_CHECK_COLLECTIVES=1: the world group then starts with checks
// on, and disagreements raise CommError without any setter.
// Runs as one process or under mpirun; prints one line per test and "N passed, M failed" (rank 0), exits non-zero
// on any failure on any rank.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/parallel/process_group.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/tensor.h"
#include "moecore/util/trace.h"
#include "parallel/dist_checks.h"

namespace {

using moecore::bf16_to_fp32;
using moecore::Device;
using moecore::DType;
using moecore::fp32_to_bf16;
using moecore::Tensor;
using moecore::parallel::CommError;
using moecore::parallel::MpiRuntime;
using moecore::parallel::ProcessGroup;
using moecore::parallel::ReduceOp;
using moecore::parallel::Work;
using namespace moecore::test;  // NOLINT: check, g_rank, g_failures (dist_checks.h)

// A pseudo-random multiple of 1/16 in [-255/16, 255/16], never zero: exact in bf16 (at most 8 significant bits),
// sums over a few ranks are exact in fp32 whatever the reduction order (so results compare exactly), and bf16
// sums of two or more ranks often need rounding.
float input_value(int rank, size_t index, uint64_t salt) {
  uint64_t z = (static_cast<uint64_t>(rank) * 0x9E3779B97F4A7C15ULL) ^ (index * 0xBF58476D1CE4E5B9ULL) ^ salt;
  z = (z ^ (z >> 31)) * 0x94D049BB133111EBULL;
  z ^= z >> 29;
  const int k = static_cast<int>(z % 510) - 255;
  return static_cast<float>(k == 0 ? 1 : k) / 16.0f;
}

std::vector<float> inputs_f32(int rank, size_t count, uint64_t salt) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = input_value(rank, i, salt);
  return values;
}

std::vector<uint16_t> inputs_bf16(int rank, size_t count, uint64_t salt) {
  std::vector<uint16_t> bits(count);
  for (size_t i = 0; i < count; ++i) bits[i] = fp32_to_bf16(input_value(rank, i, salt));
  return bits;
}

// Reference reduction of element i over ranks [0, size) (or over the listed ranks), in fp64.
double reference(const std::vector<int>& ranks, size_t index, uint64_t salt, ReduceOp op) {
  double result = op == ReduceOp::kSum ? 0.0 : -INFINITY;
  for (const int r : ranks) {
    const double value = input_value(r, index, salt);
    result = op == ReduceOp::kSum ? result + value : std::max(result, value);
  }
  return result;
}

std::vector<int> all_ranks(int size) {
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  return ranks;
}

std::string at(const char* what, size_t index, double got, double expected) {
  return std::string(what) + "[" + std::to_string(index) + "] = " + std::to_string(got) + ", expected " +
         std::to_string(expected);
}

// Runs fn expecting CommError with a one-line message on this rank.
void expect_comm_error(const std::string& what, const std::function<void()>& fn) {
  try {
    fn();
    check(false, what + ": no CommError");
  } catch (const CommError& error) {
    const std::string message = error.what();
    check(!message.empty() && message.find('\n') == std::string::npos, what + ": message not one line: " + message);
  }
}

// Block of elements rank src sends to rank dst in the all-to-all tests: uneven, and zero for some pairs.
size_t split_count(int src, int dst) { return static_cast<size_t>((src * 3 + dst * 5 + 1) % 4); }
uint16_t split_element(int src, int dst, size_t j) {
  return static_cast<uint16_t>(src * 4096 + dst * 256 + static_cast<int>(j) + 1);
}

// ---------------------------------------------------------------- tests

void test_world(const ProcessGroup& world) {
  check(world.size() >= 1 && world.rank() >= 0 && world.rank() < world.size(), "rank/size in range");
  const std::vector<float> mine = {static_cast<float>(world.rank())};
  std::vector<float> ranks(static_cast<size_t>(world.size()));
  world.all_gather<float>(mine, ranks);
  for (int r = 0; r < world.size(); ++r)
    check(ranks[static_cast<size_t>(r)] == r, "gathered rank " + std::to_string(r));
  world.barrier();
}

void test_all_reduce(const ProcessGroup& world) {
  const std::vector<int> ranks = all_ranks(world.size());
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    std::vector<float> x_f32 = inputs_f32(world.rank(), 37, 11);
    world.all_reduce<float>(x_f32, op);
    for (size_t i = 0; i < x_f32.size(); ++i) {
      const double expected = reference(ranks, i, 11, op);
      check(x_f32[i] == expected, at("fp32 all_reduce", i, x_f32[i], expected));
    }
    std::vector<uint16_t> x_bf16 = inputs_bf16(world.rank(), 29, 12);
    world.all_reduce<uint16_t>(x_bf16, op);
    for (size_t i = 0; i < x_bf16.size(); ++i) {
      // Computed in fp32 (exact here), rounded to bf16 once.
      const float expected = bf16_to_fp32(fp32_to_bf16(static_cast<float>(reference(ranks, i, 12, op))));
      check(bf16_to_fp32(x_bf16[i]) == expected, at("bf16 all_reduce", i, bf16_to_fp32(x_bf16[i]), expected));
    }
  }
  // 1 + (size - 1) * 2^-8: accumulating in bf16 would lose the small terms (1 + 2^-8 rounds to 1), in fp32 it
  // keeps them until the final rounding.
  std::vector<uint16_t> one_plus_small = {fp32_to_bf16(world.rank() == 0 ? 1.0f : 0.00390625f)};
  world.all_reduce<uint16_t>(one_plus_small, ReduceOp::kSum);
  const float expected = bf16_to_fp32(fp32_to_bf16(1.0f + 0.00390625f * static_cast<float>(world.size() - 1)));
  check(bf16_to_fp32(one_plus_small[0]) == expected,
        at("bf16 sum in fp32", 0, bf16_to_fp32(one_plus_small[0]), expected));
  std::vector<float> empty;
  world.all_reduce<float>(empty, ReduceOp::kSum);
}

// 16-bit sums on the wire: with two ranks there is one addition, so the result is exactly round(a + b) in the format;
// with more, every partial sum is rounded, so the result is within one rounding per addition of the exact sum.
void test_16bit_wire_sums(const ProcessGroup& world) {
  using moecore::DType;
  for (const DType format : {DType::kBF16, DType::kF16}) {
    const auto encode = [format](const float v) {
      return format == DType::kBF16 ? fp32_to_bf16(v) : moecore::fp32_to_fp16(v);
    };
    const auto decode = [format](const uint16_t b) {
      return format == DType::kBF16 ? bf16_to_fp32(b) : moecore::fp16_to_fp32(b);
    };
    const double unit = format == DType::kBF16 ? 1.0 / 256.0 : 1.0 / 2048.0;  // half an ulp, relative
    const size_t chunk = 7, n = chunk * static_cast<size_t>(world.size());
    std::vector<uint16_t> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = encode(input_value(world.rank(), i, 31) * 1.37f);
    const std::vector<uint16_t> input = data;
    world.all_reduce_16bit_async(data, format).wait();
    std::vector<uint16_t> shard(chunk);
    world.reduce_scatter_16bit_async(input, shard, format).wait();
    for (size_t i = 0; i < n; ++i) {
      double exact = 0.0, magnitude = 0.0;
      for (int r = 0; r < world.size(); ++r) {
        const double v = decode(encode(input_value(r, i, 31) * 1.37f));
        exact += v;
        magnitude += std::abs(v);
      }
      const double got = decode(data[i]);
      if (world.size() <= 2) {
        check(got == decode(encode(static_cast<float>(exact))), at("16-bit all_reduce", i, got, exact));
      } else {
        check(std::abs(got - exact) <= unit * magnitude * (world.size() - 1),
              at("16-bit all_reduce within its roundings", i, got, exact));
      }
      const size_t offset = chunk * static_cast<size_t>(world.rank());
      if (i >= offset && i < offset + chunk && world.size() <= 2) {
        check(decode(shard[i - offset]) == got,
              at("16-bit reduce_scatter equals the all_reduce", i, decode(shard[i - offset]), got));
      }
    }
  }
}

void test_reduce_scatter(const ProcessGroup& world) {
  const std::vector<int> ranks = all_ranks(world.size());
  const size_t chunk = 5, n = chunk * static_cast<size_t>(world.size());
  const size_t offset = chunk * static_cast<size_t>(world.rank());
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    const std::vector<float> in_f32 = inputs_f32(world.rank(), n, 21);
    std::vector<float> out_f32(chunk);
    world.reduce_scatter<float>(in_f32, out_f32, op);
    for (size_t i = 0; i < chunk; ++i) {
      const double expected = reference(ranks, offset + i, 21, op);
      check(out_f32[i] == expected, at("fp32 reduce_scatter", i, out_f32[i], expected));
    }
    const std::vector<uint16_t> in_bf16 = inputs_bf16(world.rank(), n, 22);
    std::vector<uint16_t> out_bf16(chunk);
    world.reduce_scatter<uint16_t>(in_bf16, out_bf16, op);
    for (size_t i = 0; i < chunk; ++i) {
      const float expected = bf16_to_fp32(fp32_to_bf16(static_cast<float>(reference(ranks, offset + i, 22, op))));
      check(bf16_to_fp32(out_bf16[i]) == expected, at("bf16 reduce_scatter", i, bf16_to_fp32(out_bf16[i]), expected));
    }
  }
}

void test_all_gather(const ProcessGroup& world) {
  const size_t chunk = 7;
  const std::vector<float> in_f32 = inputs_f32(world.rank(), chunk, 31);
  std::vector<float> out_f32(chunk * static_cast<size_t>(world.size()));
  world.all_gather<float>(in_f32, out_f32);
  const std::vector<uint16_t> in_bf16 = inputs_bf16(world.rank(), chunk, 32);
  std::vector<uint16_t> out_bf16(chunk * static_cast<size_t>(world.size()));
  world.all_gather<uint16_t>(in_bf16, out_bf16);
  for (int r = 0; r < world.size(); ++r) {
    for (size_t i = 0; i < chunk; ++i) {
      const size_t k = static_cast<size_t>(r) * chunk + i;
      check(out_f32[k] == input_value(r, i, 31), at("fp32 all_gather", k, out_f32[k], input_value(r, i, 31)));
      check(out_bf16[k] == fp32_to_bf16(input_value(r, i, 32)), "bf16 all_gather element " + std::to_string(k));
    }
  }
}

struct AllToAllCase {
  std::vector<size_t> send_counts, recv_counts;
  std::vector<uint16_t> send_bits, expected_bits;
};

AllToAllCase make_all_to_all_case(int rank, int size, bool all_empty) {
  AllToAllCase c;
  for (int peer = 0; peer < size; ++peer) {
    const size_t to_peer = all_empty ? 0 : split_count(rank, peer);
    const size_t from_peer = all_empty ? 0 : split_count(peer, rank);
    c.send_counts.push_back(to_peer);
    c.recv_counts.push_back(from_peer);
    for (size_t j = 0; j < to_peer; ++j) c.send_bits.push_back(split_element(rank, peer, j));
    for (size_t j = 0; j < from_peer; ++j) c.expected_bits.push_back(split_element(peer, rank, j));
  }
  return c;
}

void test_all_to_all_v(const ProcessGroup& world) {
  for (const bool all_empty : {false, true}) {
    const AllToAllCase c = make_all_to_all_case(world.rank(), world.size(), all_empty);
    check(world.exchange_counts(c.send_counts) == c.recv_counts, "exchange_counts");
    // bf16 bits and fp32 values (the same small integers) must both arrive unchanged.
    std::vector<uint16_t> out_bf16(c.expected_bits.size(), 0);
    world.all_to_all_v<uint16_t>(c.send_bits, c.send_counts, out_bf16, c.recv_counts);
    check(out_bf16 == c.expected_bits, std::string("bf16 all_to_all_v") + (all_empty ? " (all empty)" : ""));
    const std::vector<float> send_f32(c.send_bits.begin(), c.send_bits.end());
    std::vector<float> out_f32(c.expected_bits.size(), -1.0f);
    world.all_to_all_v<float>(send_f32, c.send_counts, out_f32, c.recv_counts);
    check(out_f32 == std::vector<float>(c.expected_bits.begin(), c.expected_bits.end()), "fp32 all_to_all_v");
  }
}

void test_broadcast(const ProcessGroup& world) {
  const int root = world.size() - 1;
  std::vector<float> x_f32 = inputs_f32(world.rank(), 9, 41);
  world.broadcast<float>(x_f32, root);
  std::vector<uint16_t> x_bf16 = inputs_bf16(world.rank(), 9, 42);
  world.broadcast<uint16_t>(x_bf16, root);
  for (size_t i = 0; i < 9; ++i) {
    check(x_f32[i] == input_value(root, i, 41), at("fp32 broadcast", i, x_f32[i], input_value(root, i, 41)));
    check(x_bf16[i] == fp32_to_bf16(input_value(root, i, 42)), "bf16 broadcast element " + std::to_string(i));
  }
}

void test_send_recv(const ProcessGroup& world) {
  const int n = world.size(), r = world.rank();
  if (n == 1) {
    const std::vector<float> x = {1.0f};
    expect_comm_error("send to self", [&] { world.send<float>(x, 0); });
    return;
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::vector<float> out_f32 = inputs_f32(r, 6, 51);
  const std::vector<uint16_t> out_bf16 = inputs_bf16(r, 4, 52);
  std::vector<float> in_f32(6);
  std::vector<uint16_t> in_bf16(4);
  auto send_both = [&] {
    world.send<float>(out_f32, next, 3);
    world.send<uint16_t>(out_bf16, next, 4);
  };
  auto recv_both = [&] {
    world.recv<float>(in_f32, prev, 3);
    world.recv<uint16_t>(in_bf16, prev, 4);
  };
  if (r % 2 == 0) {
    send_both();
    recv_both();
  } else {
    recv_both();
    send_both();
  }
  check(in_f32 == inputs_f32(prev, 6, 51), "fp32 ring send/recv");
  check(in_bf16 == inputs_bf16(prev, 4, 52), "bf16 ring send/recv");

  // Non-blocking: every rank posts its receive and its send at once (no even/odd ordering needed); two messages on
  // one tag arrive in posting order; a message shorter than the posted buffer raises CommError at the wait.
  std::vector<float> first(6), second(6), short_in(7);
  const std::vector<float> out2 = inputs_f32(r, 6, 53);
  const std::vector<float> short_out = inputs_f32(r, 5, 54);
  Work r1 = world.recv_async<float>(first, prev, 8);
  Work r2 = world.recv_async<float>(second, prev, 8);
  Work s1 = world.send_async<float>(out_f32, next, 8);
  Work s2 = world.send_async<float>(out2, next, 8);
  Work r3 = world.recv_async<float>(short_in, prev, 9);
  Work s3 = world.send_async<float>(short_out, next, 9);
  for (Work* w : {&r1, &r2, &s1, &s2, &s3}) w->wait();
  check(first == inputs_f32(prev, 6, 51) && second == inputs_f32(prev, 6, 53), "async sends arrive in order");
  expect_comm_error("async recv of a shorter message", [&] { r3.wait(); });
}

void test_split(const ProcessGroup& world) {
  const int parity = world.rank() % 2;
  const ProcessGroup sub = world.split(parity, world.rank());
  std::vector<int> members;
  for (int r = parity; r < world.size(); r += 2) members.push_back(r);
  check(sub.size() == static_cast<int>(members.size()), "even/odd sub-group size");
  check(sub.rank() == world.rank() / 2, "even/odd sub-group rank");
  std::vector<float> x = inputs_f32(world.rank(), 13, 61);
  sub.all_reduce<float>(x, ReduceOp::kSum);
  for (size_t i = 0; i < x.size(); ++i) {
    const double expected = reference(members, i, 61, ReduceOp::kSum);
    check(x[i] == expected, at("sub-group all_reduce", i, x[i], expected));
  }
  // Sub-group all_to_all_v over sub-group ranks.
  const AllToAllCase c = make_all_to_all_case(sub.rank(), sub.size(), false);
  std::vector<uint16_t> out(c.expected_bits.size());
  sub.all_to_all_v<uint16_t>(c.send_bits, c.send_counts, out, c.recv_counts);
  check(out == c.expected_bits, "sub-group all_to_all_v");
  // key orders the new ranks: a negated key reverses them.
  const ProcessGroup reversed = world.split(0, -world.rank());
  check(reversed.size() == world.size() && reversed.rank() == world.size() - 1 - world.rank(), "split key order");
  expect_comm_error("negative color", [&] { (void)world.split(-1, 0); });
}

void test_async(const ProcessGroup& world) {
  const std::vector<int> ranks = all_ranks(world.size());
  const size_t chunk = 6, n = chunk * static_cast<size_t>(world.size());
  std::vector<float> reduced_f32 = inputs_f32(world.rank(), 40, 71);
  std::vector<uint16_t> reduced_bf16 = inputs_bf16(world.rank(), 40, 72);
  const std::vector<uint16_t> scatter_in = inputs_bf16(world.rank(), n, 73);
  std::vector<uint16_t> scatter_out(chunk);
  const std::vector<float> gather_in = inputs_f32(world.rank(), chunk, 74);
  std::vector<float> gather_out(n);
  const AllToAllCase c = make_all_to_all_case(world.rank(), world.size(), false);
  std::vector<uint16_t> a2a_out(c.expected_bits.size());

  Work w1 = world.all_reduce_async<float>(reduced_f32, ReduceOp::kSum);
  Work w2 = world.all_reduce_async<uint16_t>(reduced_bf16, ReduceOp::kSum);
  Work w3 = world.reduce_scatter_async<uint16_t>(scatter_in, scatter_out, ReduceOp::kSum);
  Work w4 = world.all_gather_async<float>(gather_in, gather_out);
  Work w5 = world.all_to_all_v_async<uint16_t>(c.send_bits, c.send_counts, a2a_out, c.recv_counts);
  // Local work while the collectives are in flight, polling them now and then.
  double local = 0.0;
  for (int i = 0; i < 200000; ++i) {
    local += std::sin(0.001 * i);
    if (i % 20000 == 0) (void)w1.test();
  }
  check(std::isfinite(local), "local work");
  for (Work* w : {&w1, &w2, &w3, &w4, &w5}) w->wait();
  for (Work* w : {&w1, &w2, &w3, &w4, &w5}) check(w->done(), "work done after wait");
  w1.wait();  // waiting twice is harmless

  for (size_t i = 0; i < 40; ++i) {
    const double expected_f32 = reference(ranks, i, 71, ReduceOp::kSum);
    check(reduced_f32[i] == expected_f32, at("async fp32 all_reduce", i, reduced_f32[i], expected_f32));
    const float expected_bf16 = bf16_to_fp32(fp32_to_bf16(static_cast<float>(reference(ranks, i, 72, ReduceOp::kSum))));
    check(bf16_to_fp32(reduced_bf16[i]) == expected_bf16,
          at("async bf16 all_reduce", i, bf16_to_fp32(reduced_bf16[i]), expected_bf16));
  }
  const size_t offset = chunk * static_cast<size_t>(world.rank());
  for (size_t i = 0; i < chunk; ++i) {
    const float expected =
        bf16_to_fp32(fp32_to_bf16(static_cast<float>(reference(ranks, offset + i, 73, ReduceOp::kSum))));
    check(bf16_to_fp32(scatter_out[i]) == expected,
          at("async bf16 reduce_scatter", i, bf16_to_fp32(scatter_out[i]), expected));
  }
  for (size_t k = 0; k < n; ++k) {
    const float expected = input_value(static_cast<int>(k / chunk), k % chunk, 74);
    check(gather_out[k] == expected, at("async all_gather", k, gather_out[k], expected));
  }
  check(a2a_out == c.expected_bits, "async all_to_all_v");

  // A dropped handle waits in its destructor, so the buffer is complete afterwards.
  std::vector<float> dropped = inputs_f32(world.rank(), 8, 75);
  { const Work ignored = world.all_reduce_async<float>(dropped, ReduceOp::kMax); }
  for (size_t i = 0; i < dropped.size(); ++i) {
    const double expected = reference(ranks, i, 75, ReduceOp::kMax);
    check(dropped[i] == expected, at("dropped async all_reduce", i, dropped[i], expected));
  }
}

// drive_progress() alone completes operations in flight (running their finish step: the bf16 result is rounded into
// place before any wait), and each completed operation is an event on the timeline's "comm in flight" track.
void test_drive_progress(const ProcessGroup& world) {
  const std::vector<int> ranks = all_ranks(world.size());
  std::vector<uint16_t> reduced_bf16 = inputs_bf16(world.rank(), 4096, 76);
  const std::vector<float> gather_in = inputs_f32(world.rank(), 512, 77);
  std::vector<float> gather_out(512 * static_cast<size_t>(world.size()));
  const int before = moecore::parallel::operations_in_flight();
  // One file per process: other runs of this test (its layouts under ctest -j) write theirs at the same time.
  const std::string trace_path =
      "/tmp/moecore_drive_progress_" + std::to_string(getpid()) + "_" + std::to_string(world.rank()) + ".json";
  moecore::trace::start(world.rank());
  Work w1 = world.all_reduce_async<uint16_t>(reduced_bf16, ReduceOp::kSum);
  w1.trace_as("probe all-reduce");
  Work w2 = world.all_gather_async<float>(gather_in, gather_out);
  check(moecore::parallel::operations_in_flight() == before + 2, "two operations in flight");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (moecore::parallel::operations_in_flight() > before && std::chrono::steady_clock::now() < deadline) {
    moecore::parallel::drive_progress();
  }
  moecore::trace::stop();
  check(w1.done() && w2.done(), "drive_progress completes the operations without a wait");
  for (size_t i = 0; i < reduced_bf16.size(); ++i) {
    const float expected = bf16_to_fp32(fp32_to_bf16(static_cast<float>(reference(ranks, i, 76, ReduceOp::kSum))));
    if (bf16_to_fp32(reduced_bf16[i]) != expected) {
      check(false, at("bf16 all_reduce completed by drive_progress", i, bf16_to_fp32(reduced_bf16[i]), expected));
      break;
    }
  }
  for (size_t k = 0; k < gather_out.size(); ++k) {
    const float expected = input_value(static_cast<int>(k / 512), k % 512, 77);
    if (gather_out[k] != expected) {
      check(false, at("all_gather completed by drive_progress", k, gather_out[k], expected));
      break;
    }
  }
  moecore::trace::write(trace_path);
  std::ifstream in(trace_path);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(trace_path.c_str());
  const std::string json = text.str();
  check(json.find("\"name\": \"comm in flight\"") != std::string::npos, "the trace has a comm in flight track");
  check(json.find("\"name\": \"probe all-reduce\"") != std::string::npos, "the all-reduce under its trace name");
  check(json.find("\"name\": \"all_gather_async\"") != std::string::npos, "the all-gather under its own name");
}

// Integer elements travel and reduce exactly, also beyond fp32's 2^24 and fp64's 2^53.
void test_integers(const ProcessGroup& world) {
  const int n = world.size(), r = world.rank();
  const int64_t big = (int64_t{1} << 53) + 1;  // not representable in fp32 nor fp64
  const std::vector<int64_t> mine = {big + r, -big - 3 * r, (int64_t{1} << 24) + 1 + r};
  std::vector<int64_t> gathered(3 * static_cast<size_t>(n));
  world.all_gather<int64_t>(mine, gathered);
  for (int s = 0; s < n; ++s) {
    const size_t k = 3 * static_cast<size_t>(s);
    check(gathered[k] == big + s && gathered[k + 1] == -big - 3 * s && gathered[k + 2] == (int64_t{1} << 24) + 1 + s,
          "int64 all_gather from rank " + std::to_string(s));
  }
  std::vector<int64_t> summed = mine;
  world.all_reduce<int64_t>(summed, ReduceOp::kSum);
  const int64_t ranks_sum = static_cast<int64_t>(n) * (n - 1) / 2;
  check(summed[0] == big * n + ranks_sum, "int64 all_reduce sum beyond 2^53");
  check(summed[2] == ((int64_t{1} << 24) + 1) * n + ranks_sum, "int64 all_reduce sum beyond 2^24");
  std::vector<int32_t> maxed = {(1 << 24) + 1 + r, -r};
  world.all_reduce<int32_t>(maxed, ReduceOp::kMax);
  check(maxed[0] == (1 << 24) + n && maxed[1] == 0, "int32 all_reduce max");
  // all_to_all_v: rank r sends split_count(r, d) values to rank d, each above 2^24.
  std::vector<size_t> send_counts, recv_counts;
  std::vector<int64_t> sent, expected;
  auto value = [](int src, int dst, size_t j) {
    return (int64_t{1} << 40) + src * 1000003 + dst * 1009 + static_cast<int64_t>(j);
  };
  for (int peer = 0; peer < n; ++peer) {
    send_counts.push_back(split_count(r, peer));
    recv_counts.push_back(split_count(peer, r));
    for (size_t j = 0; j < send_counts.back(); ++j) sent.push_back(value(r, peer, j));
    for (size_t j = 0; j < recv_counts.back(); ++j) expected.push_back(value(peer, r, j));
  }
  std::vector<int64_t> received(expected.size(), -1);
  world.all_to_all_v<int64_t>(sent, send_counts, received, recv_counts);
  check(received == expected, "int64 all_to_all_v");
  std::vector<int32_t> root_value = {r == 0 ? std::numeric_limits<int32_t>::max() : 0};
  world.broadcast<int32_t>(root_value, 0);
  check(root_value[0] == std::numeric_limits<int32_t>::max(), "int32 broadcast");
}

// Checks off: arguments invalid on every rank still raise CommError (no rank enters MPI), and the group stays
// usable; collectives that agree give the same results as with checks on (the other tests, run twice).
void test_local_errors(const ProcessGroup& world) {
  const int n = world.size();
  expect_comm_error("all_gather wrong output size on every rank", [&] {
    const std::vector<float> in(3, 1.0f);
    std::vector<float> out(3 * static_cast<size_t>(n) + 1);
    world.all_gather<float>(in, out);
  });
  expect_comm_error("all_to_all_v counts that do not sum to the buffer on every rank", [&] {
    const std::vector<size_t> counts(static_cast<size_t>(n), 1);
    const std::vector<int64_t> in(static_cast<size_t>(n) + 1, 1);
    std::vector<int64_t> out(static_cast<size_t>(n));
    world.all_to_all_v<int64_t>(in, counts, out, counts);
  });
  expect_comm_error("negative split color on every rank", [&] { (void)world.split(-1, 0); });
  std::vector<float> x = {1.0f};
  world.all_reduce<float>(x, ReduceOp::kSum);
  check(x[0] == n, "group usable after local errors");
}

// Sizes or operations that disagree across ranks, or invalid arguments on one rank, must throw CommError on every
// rank, and leave the group usable.
void test_mismatches(const ProcessGroup& world) {
  const int n = world.size(), r = world.rank();
  const bool last = r == n - 1;
  auto still_usable = [&](const std::string& after) {
    std::vector<float> x = {1.0f, static_cast<float>(r)};
    world.all_reduce<float>(x, ReduceOp::kSum);
    check(x[0] == n && x[1] == n * (n - 1) / 2.0f, "group usable after " + after);
  };

  // Invalid output size on the last rank only (detectable even in a world of one).
  expect_comm_error("all_gather wrong output size on one rank", [&] {
    const std::vector<float> in(3, 1.0f);
    std::vector<float> out(3 * static_cast<size_t>(n) + (last ? 1 : 0));
    world.all_gather<float>(in, out);
  });
  still_usable("all_gather invalid output");
  expect_comm_error("reduce_scatter wrong input size", [&] {
    const std::vector<uint16_t> in(2 * static_cast<size_t>(n) + (last ? 1 : 0), 0x3f80);
    std::vector<uint16_t> out(2);
    world.reduce_scatter<uint16_t>(in, out, ReduceOp::kSum);
  });
  expect_comm_error("all_to_all_v counts that do not sum to the buffer", [&] {
    const std::vector<size_t> counts(static_cast<size_t>(n), 1);
    const std::vector<float> in(static_cast<size_t>(n) + (last ? 2 : 0), 1.0f);
    std::vector<float> out(static_cast<size_t>(n));
    world.all_to_all_v<float>(in, counts, out, counts);
  });
  expect_comm_error("broadcast root outside group", [&] {
    std::vector<float> x(2, 1.0f);
    world.broadcast<float>(x, n);
  });
  if (n == 1) return;

  expect_comm_error("all_gather with different counts", [&] {
    const size_t count = r == 0 ? 3 : 4;
    const std::vector<float> in(count, 1.0f);
    std::vector<float> out(count * static_cast<size_t>(n));
    world.all_gather<float>(in, out);
  });
  still_usable("all_gather count mismatch");
  expect_comm_error("all_reduce with different counts", [&] {
    std::vector<uint16_t> x(static_cast<size_t>(5 + r), 0x3f80);
    world.all_reduce<uint16_t>(x, ReduceOp::kSum);
  });
  expect_comm_error("async all_reduce with different ops", [&] {
    std::vector<float> x(4, 1.0f);
    world.all_reduce_async<float>(x, r == 0 ? ReduceOp::kSum : ReduceOp::kMax).wait();
  });
  expect_comm_error("broadcast with different roots", [&] {
    std::vector<float> x(2, 1.0f);
    world.broadcast<float>(x, r == 0 ? 0 : 1);
  });
  expect_comm_error("different collectives", [&] {
    std::vector<float> x(2, 1.0f);
    if (r == 0) {
      world.all_reduce<float>(x, ReduceOp::kSum);
    } else {
      world.broadcast<float>(x, 0);
    }
  });
  still_usable("different collectives");
  expect_comm_error("all_to_all_v recv_counts that disagree with the senders", [&] {
    AllToAllCase c = make_all_to_all_case(r, n, false);
    if (last) {  // expects one element more from rank 0 than rank 0 sends
      c.recv_counts[0] += 1;
      c.expected_bits.push_back(0);
    }
    std::vector<uint16_t> out(c.expected_bits.size());
    world.all_to_all_v_async<uint16_t>(c.send_bits, c.send_counts, out, c.recv_counts).wait();
  });
  still_usable("all_to_all_v count mismatch");

  // Point to point between ranks 0 and 1: a longer buffer than the message, then a shorter one (MPI truncation).
  if (r <= 1) {
    const std::vector<float> message(5, 2.0f);
    for (const size_t recv_size : {6, 4}) {
      if (r == 0) {
        world.send<float>(message, 1, 9);
      } else {
        std::vector<float> buffer(recv_size);
        expect_comm_error("recv of " + std::to_string(recv_size) + " elements for a 5-element message",
                          [&] { world.recv<float>(buffer, 0, 9); });
      }
    }
  }
  still_usable("recv size mismatch");
}

using Test = std::pair<std::string, std::function<void()>>;

// The world group's default comes from the environment: off here, or on with --env-checks (and then inherited by
// split groups); the setter switches one handle.
void test_check_setting(const ProcessGroup& world, const bool env_checks) {
  check(world.agreement_checks() == env_checks,
        std::string("world() starts with agreement checks ") + (env_checks ? "on" : "off"));
  const ProcessGroup sub = world.split(world.rank() % 2, world.rank());
  check(sub.agreement_checks() == env_checks, "split inherits the agreement-check setting");
  ProcessGroup flipped = world;
  flipped.set_agreement_checks(!env_checks);
  check(flipped.agreement_checks() == !env_checks && world.agreement_checks() == env_checks,
        "set_agreement_checks switches one handle");
  check(flipped.split(0, world.rank()).agreement_checks() == !env_checks, "split inherits the set value");
  check(!ProcessGroup::self().agreement_checks(), "self() has no checks");
}

// `checked` is `world` with agreement checks switched on.
// ---------------------------------------------------------------- tensor forms

// A [rows, cols] tensor of `dtype` on `device` holding inputs_f32(rank, ..., salt) (bf16 / fp16: rounded; integers:
// times 16, exact).
Tensor input_tensor(const int rank, const int64_t rows, const int64_t cols, const DType dtype, const uint64_t salt,
                    const Device device = Device::kCPU) {
  Tensor t({rows, cols}, dtype, moecore::MemCategory::kOther, device);
  const std::vector<float> values = inputs_f32(rank, static_cast<size_t>(rows * cols), salt);
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kF32: t.data<float>()[i] = values[i]; break;
      case DType::kF64: t.data<double>()[i] = values[i]; break;
      case DType::kBF16: t.data<uint16_t>()[i] = fp32_to_bf16(values[i]); break;
      case DType::kF16: t.data<uint16_t>()[i] = moecore::fp32_to_fp16(values[i]); break;
      case DType::kI64: t.data<int64_t>()[i] = static_cast<int64_t>(values[i] * 16); break;
      case DType::kU8: t.data<uint8_t>()[i] = static_cast<uint8_t>(static_cast<int>(values[i] * 16) & 0xff); break;
      default: break;
    }
  }
  return t;
}

// Whether two tensors hold the same bytes.
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data<std::byte>(), b.data<std::byte>(), a.nbytes()) == 0;
}

// Each rank's block of a gathered tensor is that rank's input, bit for bit, for every dtype a move takes (fp64 and
// fp16 included), on both host devices; reductions equal the span forms'.
void test_tensor_forms(const ProcessGroup& world) {
  const int size = world.size(), rank = world.rank();
  for (const Device device : {Device::kCPU, Device::kReference}) {
    const std::string on = std::string(" on ") + std::string(moecore::device_name(device));
    for (const DType dtype : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kI64, DType::kU8}) {
      const std::string what = std::string(moecore::dtype_name(dtype)) + on;
      const Tensor mine = input_tensor(rank, 3, 5, dtype, 61, device);
      Tensor all({size * 3, 5}, dtype, moecore::MemCategory::kOther, device);
      world.all_gather(mine, all);
      Tensor all_async({size * 3, 5}, dtype, moecore::MemCategory::kOther, device);
      world.all_gather_async(mine, all_async).wait();
      for (int r = 0; r < size; ++r) {
        const Tensor want = input_tensor(r, 3, 5, dtype, 61, device);
        check(same_bits(all.slice_rows(r * 3, r * 3 + 3), want), what + ": all_gather block " + std::to_string(r));
        check(same_bits(all_async.slice_rows(r * 3, r * 3 + 3), want),
              what + ": all_gather_async block " + std::to_string(r));
      }
      Tensor root_data = input_tensor(0, 2, 3, dtype, 62, device);
      Tensor data = input_tensor(rank, 2, 3, dtype, 62, device);
      world.broadcast(data, 0);
      check(same_bits(data, root_data), what + ": broadcast");
    }
    // Sums and maxima: the span forms' results.
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
      const std::string what = std::string(moecore::dtype_name(dtype)) + on;
      for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        Tensor data = input_tensor(rank, 4, 3, dtype, 63, device);
        Tensor want = data.clone();
        world.all_reduce(data, op);
        if (dtype == DType::kF32) world.all_reduce<float>(want.span<float>(), op);
        if (dtype == DType::kBF16) world.all_reduce<uint16_t>(want.span<uint16_t>(), op);
        if (dtype == DType::kI64) world.all_reduce<int64_t>(want.span<int64_t>(), op);
        check(same_bits(data, want), what + ": all_reduce");
        Tensor again = input_tensor(rank, 4, 3, dtype, 63, device);
        world.all_reduce_async(again, op).wait();
        check(same_bits(again, want), what + ": all_reduce_async");
      }
      const Tensor input = input_tensor(rank, 2 * size, 3, dtype, 64, device);
      Tensor out({2, 3}, dtype, moecore::MemCategory::kOther, device), out_async = out.clone();
      world.reduce_scatter(input, out, ReduceOp::kSum);
      world.reduce_scatter_async(input, out_async, ReduceOp::kSum).wait();
      Tensor full = input.clone();
      if (dtype == DType::kF32) world.all_reduce<float>(full.span<float>(), ReduceOp::kSum);
      if (dtype == DType::kBF16) world.all_reduce<uint16_t>(full.span<uint16_t>(), ReduceOp::kSum);
      if (dtype == DType::kI64) world.all_reduce<int64_t>(full.span<int64_t>(), ReduceOp::kSum);
      check(same_bits(out, full.slice_rows(2 * rank, 2 * rank + 2)), what + ": reduce_scatter");
      check(same_bits(out_async, full.slice_rows(2 * rank, 2 * rank + 2)), what + ": reduce_scatter_async");
    }
    // All-to-all of fp16 bits with uneven counts, blocking and not.
    const AllToAllCase c = make_all_to_all_case(rank, size, false);
    Tensor send({static_cast<int64_t>(c.send_bits.size())}, DType::kF16, moecore::MemCategory::kOther, device);
    std::memcpy(send.data<uint16_t>(), c.send_bits.data(), c.send_bits.size() * sizeof(uint16_t));
    Tensor received({static_cast<int64_t>(c.expected_bits.size())}, DType::kF16, moecore::MemCategory::kOther, device);
    Tensor received_async = received.clone();
    world.all_to_all_v(send, c.send_counts, received, c.recv_counts);
    world.all_to_all_v_async(send, c.send_counts, received_async, c.recv_counts).wait();
    const std::vector<uint16_t> got(received.data<uint16_t>(), received.data<uint16_t>() + received.numel());
    const std::vector<uint16_t> got_async(received_async.data<uint16_t>(),
                                          received_async.data<uint16_t>() + received_async.numel());
    check(got == c.expected_bits, "fp16 all_to_all_v" + on);
    check(got_async == c.expected_bits, "fp16 all_to_all_v_async" + on);
    // A ring: rank r sends its fp64 tensor to r + 1, blocking and not.
    if (size > 1) {
      const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
      const Tensor out_msg = input_tensor(rank, 2, 2, DType::kF64, 65, device);
      Tensor in_msg({2, 2}, DType::kF64, moecore::MemCategory::kOther, device), in_async = in_msg.clone();
      Work receiving = world.recv_async(in_async, prev, 7);
      Work sending = world.send_async(out_msg, next, 7);
      receiving.wait();
      sending.wait();
      if (rank % 2 == 0) {
        world.send(out_msg, next, 8);
        world.recv(in_msg, prev, 8);
      } else {
        world.recv(in_msg, prev, 8);
        world.send(out_msg, next, 8);
      }
      const Tensor want = input_tensor(prev, 2, 2, DType::kF64, 65, device);
      check(same_bits(in_msg, want), "fp64 send / recv" + on);
      check(same_bits(in_async, want), "fp64 send_async / recv_async" + on);
    }
  }
}

// Tensor forms refuse, on this rank and before any communication, what the span forms cannot express: a reduction
// of a dtype without one, tensors of two dtypes, sizes that do not fit.
void test_tensor_errors(const ProcessGroup& world) {
  const int size = world.size();
  Tensor f64({4}, DType::kF64), f16({4}, DType::kF16);
  expect_comm_error("fp64 all_reduce", [&] { world.all_reduce(f64, ReduceOp::kSum); });
  expect_comm_error("fp16 all_reduce_async", [&] { world.all_reduce_async(f16, ReduceOp::kSum); });
  Tensor f32_in({3}, DType::kF32), bf16_out({3 * size}, DType::kBF16), f32_short({3 * size + 1}, DType::kF32);
  expect_comm_error("all_gather fp32 into bf16", [&] { world.all_gather(f32_in, bf16_out); });
  expect_comm_error("all_gather into a wrong size", [&] { world.all_gather(f32_in, f32_short); });
  expect_comm_error("reduce_scatter from a wrong size",
                    [&] { world.reduce_scatter(f32_short, f32_in, ReduceOp::kSum); });
  expect_comm_error("undefined tensor", [&] {
    Tensor none;
    world.broadcast(none, 0);
  });
}

std::vector<Test> make_tests(const ProcessGroup& world, const ProcessGroup& checked, const bool env_checks) {
  std::vector<Test> tests = {{"check setting", [&world, env_checks] { test_check_setting(world, env_checks); }}};
  if (env_checks) {  // checks from the environment alone catch disagreements
    tests.emplace_back("mismatches [checks from MOECORE_CHECK_COLLECTIVES]", [&world] { test_mismatches(world); });
    return tests;
  }
  const std::vector<std::pair<const char*, void (*)(const ProcessGroup&)>> results = {
      {"world", test_world},
      {"all_reduce", test_all_reduce},
      {"reduce_scatter", test_reduce_scatter},
      {"all_gather", test_all_gather},
      {"all_to_all_v", test_all_to_all_v},
      {"broadcast", test_broadcast},
      {"send_recv", test_send_recv},
      {"split", test_split},
      {"async", test_async},
      {"drive_progress", test_drive_progress},
      {"integers", test_integers},
      {"16-bit wire sums", test_16bit_wire_sums},
      {"tensor forms", test_tensor_forms},
  };
  for (const ProcessGroup* group : {&world, &checked}) {
    const std::string suffix = group->agreement_checks() ? " [checks on]" : " [checks off]";
    for (const auto& [name, fn] : results) tests.emplace_back(name + suffix, [group, fn] { fn(*group); });
  }
  tests.emplace_back("local errors [checks off]", [&world] { test_local_errors(world); });
  tests.emplace_back("tensor form errors [checks off]", [&world] { test_tensor_errors(world); });
  tests.emplace_back("mismatches [checks on]", [&checked] { test_mismatches(checked); });
  return tests;
}

}  // namespace

int main(int argc, char** argv) {
  const MpiRuntime mpi(&argc, &argv);
  const bool env_checks = argc > 1 && std::strcmp(argv[1], "--env-checks") == 0;
  int failed_total = 0;
  try {
    const ProcessGroup world = ProcessGroup::world();
    g_rank = world.rank();
    ProcessGroup checked = world;
    checked.set_agreement_checks(true);
    const std::vector<Test> tests = make_tests(world, checked, env_checks);
    std::vector<float> failed(tests.size(), 0.0f);
    for (size_t t = 0; t < tests.size(); ++t) {
      g_failures = 0;
      try {
        tests[t].second();
      } catch (const std::exception& error) {
        ++g_failures;
        std::fprintf(stderr, "[rank %d] %s threw: %s\n", g_rank, tests[t].first.c_str(), error.what());
      }
      failed[t] = g_failures > 0 ? 1.0f : 0.0f;
    }
    world.all_reduce<float>(failed, ReduceOp::kMax);  // a test fails if it failed on any rank
    int passed = 0;
    for (size_t t = 0; t < tests.size(); ++t) {
      if (failed[t] > 0)
        ++failed_total;
      else
        ++passed;
      if (world.rank() == 0)
        std::printf("%s %s (%d ranks)\n", failed[t] > 0 ? "FAIL" : "ok  ", tests[t].first.c_str(), world.size());
    }
    if (world.rank() == 0) std::printf("%d passed, %d failed\n", passed, failed_total);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] fatal: %s\n", g_rank, error.what());
    return 2;
  }
  return failed_total > 0 ? 1 : 0;
}
