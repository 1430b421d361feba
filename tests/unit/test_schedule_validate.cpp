// The validator, lowering and the sharding actions on hand-written
// schedules: one test per rule, each asserting that the message names the
// rank, the step and what is wrong.
#include <catch2/catch.hpp>
#include <string>

#include "test_schedule_support.hpp"

namespace {

using Catch::Contains;
using meshrun::schedule::add_sharding_actions;
using meshrun::schedule::lower;
using meshrun::schedule::validate;
using meshrun::schedule::validate_compute;
using schedule_testing::error_of;
using schedule_testing::schedule_of;
using schedule_testing::Strings;
using schedule_testing::strings_of;

// 1F1B on 2 ranks, 2 microbatches, as lowering writes it.
const Strings kLowered1f1b = {
    {"0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"},
    {"1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"}};

std::string compute_error(const Strings& ranks, int64_t microbatches) {
  return error_of([&] { validate_compute(schedule_of(ranks, 1, microbatches)); });
}

std::string full_error(const Strings& ranks, int64_t microbatches) {
  return error_of([&] { validate(schedule_of(ranks, 1, microbatches)); });
}

}  // namespace

TEST_CASE("schedule validation: a lowered 1F1B passes", "[schedule][validate]") {
  validate(schedule_of(kLowered1f1b, 1, 2));
}

TEST_CASE("schedule validation: compute order rules", "[schedule][validate]") {
  CHECK_THAT(compute_error({{"0F0", "0F0", "0B0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 1: 0F0: runs a second time"));
  CHECK_THAT(compute_error({{"0F0", "0B0"}, {"1B0", "1F0"}}, 1),
             Contains("rank 1 step 0: 1B0: runs before the F of its microbatch"));
  CHECK_THAT(compute_error({{"0F0", "0I0", "0W0"}, {"1F0", "1W0", "1I0"}}, 1),
             Contains("rank 1 step 1: 1W0: runs before the I of its microbatch"));
  CHECK_THAT(compute_error({{"0F0", "0B0", "0I0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 2: 0I0: the microbatch's backward already ran"));
  CHECK_THAT(compute_error({{"0F0", "0B0"}, {"1F0", "1B0", "1F1"}}, 2),
             Contains("rank 0 step 2: stage 0 never runs F for microbatch 1"));
  CHECK_THAT(compute_error({{"0F0", "0I0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 2: stage 0 never runs the W after its I for microbatch 0"));
  CHECK_THAT(compute_error({{"0F0", "1B0"}, {"1F0", "0B0"}}, 1),
             Contains("rank 0 step 1: 1B0: stage 1 is placed on rank 1, not on rank 0"));
  CHECK_THAT(compute_error({{"0F0", "0B0"}, {"2F0"}}, 1),
             Contains("rank 1 step 0: 2F0: stage 2 does not exist (the schedule has stages 0..1)"));
  CHECK_THAT(compute_error({{"0F0", "0B0"}, {"1F3"}}, 1),
             Contains("microbatch 3 does not exist (the schedule has microbatches 0..0)"));
  CHECK_THAT(compute_error({{"0F0", "0SEND_F0", "0B0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 1: 0SEND_F0: a compute-only schedule holds no communication"));
}

TEST_CASE("schedule validation: stages on one rank wait for each other in its list",
          "[schedule][validate]") {
  // V placement on one rank: stages 0 and 1 both on rank 0.
  const auto v = [](const Strings& ranks) {
    return error_of([&] { validate(schedule_of(ranks, 2, 1, {0, 0})); });
  };
  validate(schedule_of({{"0F0", "1F0", "1B0", "0B0"}}, 2, 1, {0, 0}));
  CHECK_THAT(v({{"1F0", "0F0", "1B0", "0B0"}}),
             Contains("rank 0 step 0: 1F0: its input comes from stage 0 on this rank, which has "
                      "not yet run microbatch 0 there"));
  CHECK_THAT(v({{"0F0", "1F0", "0B0", "1B0"}}),
             Contains("rank 0 step 2: 0B0: its input comes from stage 1 on this rank"));
  CHECK_THAT(v({{"0F0", "0SEND_F0", "1F0", "1B0", "0B0"}}),
             Contains("rank 0 step 1: 0SEND_F0: stage 1 is on this rank too: its data passes "
                      "without communication"));
}

TEST_CASE("schedule validation: communication rules", "[schedule][validate]") {
  CHECK_THAT(full_error({{"0F0", "0SEND_F0", "0RECV_B0", "0B0"}, {"1F0", "1B0", "1SEND_B0"}}, 1),
             Contains("rank 1 step 0: 1F0: its input from stage 0 on rank 0 is not received: no "
                      "1RECV_F0 earlier on this rank"));
  CHECK_THAT(
      full_error({{"0SEND_F0", "0F0", "0RECV_B0", "0B0"}, {"1RECV_F0", "1F0", "1B0", "1SEND_B0"}},
                 1),
      Contains("rank 0 step 0: 0SEND_F0: sends before the F that produces it"));
  CHECK_THAT(full_error({{"0F0", "0SEND_F0", "0RECV_B0", "0B0"},
                         {"1RECV_F0", "1F0", "1B0", "1SEND_B0", "1SEND_B0"}},
                        1),
             Contains("rank 1 step 4: 1SEND_B0: runs a second time"));
  CHECK_THAT(full_error({{"0F0", "0SEND_F0", "0RECV_B0", "0B0", "0SEND_B0"},
                         {"1RECV_F0", "1F0", "1B0", "1SEND_B0"}},
                        1),
             Contains("rank 0 step 4: 0SEND_B0: stage 0 has no neighbour stage -1"));
  CHECK_THAT(full_error({{"0F0", "0RECV_B0", "0B0"}, {"1RECV_F0", "1F0", "1B0", "1SEND_B0"}}, 1),
             Contains("rank 0 step 3: stage 0 never runs SEND_F for microbatch 0"));
}

TEST_CASE("schedule validation: a deadlock is reported as the cycle of waiting ranks",
          "[schedule][validate]") {
  // Both ranks start by receiving.
  CHECK_THAT(
      full_error({{"0F0", "0RECV_B0", "0SEND_F0", "0B0"}, {"1RECV_F0", "1F0", "1B0", "1SEND_B0"}},
                 1),
      Contains("the schedule deadlocks with blocking sends and receives: rank 0 step 1: "
               "0RECV_B0 waits for rank 1; rank 1 step 0: 1RECV_F0 waits for rank 0"));
  // Three ranks, two looped stages each, every one waiting to receive.
  const Strings ring = {{"0F0", "0SEND_F0", "3RECV_F0", "3F0", "3SEND_F0", "3RECV_B0", "3B0",
                         "3SEND_B0", "0RECV_B0", "0B0"},
                        {"1RECV_F0", "1F0", "4RECV_F0", "1SEND_F0", "4F0", "4SEND_F0", "4RECV_B0",
                         "4B0", "4SEND_B0", "1RECV_B0", "1B0", "1SEND_B0"},
                        {"2RECV_F0", "2F0", "5RECV_F0", "2SEND_F0", "5F0", "5B0", "5SEND_B0",
                         "2RECV_B0", "2B0", "2SEND_B0"}};
  CHECK_THAT(error_of([&] { validate(schedule_of(ring, 2, 1)); }),
             Contains("rank 0 step 2: 3RECV_F0 waits for rank 2; rank 2 step 0: 2RECV_F0 "
                      "waits for rank 1; rank 1 step 2: 4RECV_F0 waits for rank 0"));
}

TEST_CASE("schedule validation: sends and receives between two ranks must pair in order",
          "[schedule][validate]") {
  CHECK_THAT(
      full_error({{"0F0", "0F1", "0SEND_F1", "0SEND_F0", "0RECV_B0", "0B0", "0RECV_B1", "0B1"},
                  {"1RECV_F0", "1RECV_F1", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"}},
                 2),
      Contains("a send meets the wrong receive: rank 0 step 2: 0SEND_F1 meets rank 1 step 0: "
               "1RECV_F0; what rank 0 sends to rank 1 must be received in the order it is sent"));
}

TEST_CASE("schedule lowering: an order that cannot run names the waiting cycle",
          "[schedule][validate]") {
  // Rank 0 wants 0B0 before it runs 0F1; rank 1 runs 1F1 before 1B0.
  CHECK_THAT(
      error_of([&] {
        lower(schedule_of({{"0F0", "0B0", "0F1", "0B1"}, {"1F0", "1F1", "1B1", "1B0"}}, 1, 2));
      }),
      Contains("the compute order cannot run: rank 0 step 1: 0B0 waits for the backward "
               "of stage 1 microbatch 0 on rank 1; rank 1 step 1: 1F1 waits for the F "
               "of stage 0 microbatch 1 on rank 0"));
  CHECK_THAT(error_of([&] { lower(schedule_of(kLowered1f1b, 1, 2)); }),
             Contains("a compute-only schedule holds no communication"));
}

TEST_CASE("schedule sharding: unshard before the first compute, reduce and reshard after the last",
          "[schedule][validate]") {
  const auto sharded = add_sharding_actions(schedule_of(kLowered1f1b, 1, 2));
  CHECK(strings_of(sharded) ==
        Strings{{"0UNSHARD", "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1",
                 "0B1", "0REDUCE_GRAD", "0RESHARD"},
                {"1RECV_F0", "1UNSHARD", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1",
                 "1SEND_B1", "1REDUCE_GRAD", "1RESHARD"}});
  validate(sharded);
  CHECK_THAT(error_of([&] { add_sharding_actions(sharded); }),
             Contains("rank 0 step 0: 0UNSHARD: the schedule already holds sharding actions"));
}

TEST_CASE("schedule validation: sharding rules", "[schedule][validate]") {
  const Strings outside = {{"0UNSHARD", "0F0", "0RESHARD", "0B0"}, {"1F0", "1B0"}};
  CHECK_THAT(compute_error(outside, 1),
             Contains("rank 0 step 3: 0B0: stage 0 is not unsharded here"));
  CHECK_THAT(compute_error({{"0F0", "0REDUCE_GRAD", "0B0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 1: 0REDUCE_GRAD: runs after 0 of the stage's 1 backwards"));
  CHECK_THAT(compute_error({{"0F0", "0B0", "0RESHARD"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 2: 0RESHARD: the stage is not unsharded"));
  CHECK_THAT(compute_error({{"0UNSHARD", "0UNSHARD", "0F0", "0B0"}, {"1F0", "1B0"}}, 1),
             Contains("rank 0 step 1: 0UNSHARD: the stage is already unsharded"));
}
