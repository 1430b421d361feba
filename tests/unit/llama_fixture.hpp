// Llama stages over storage of their own, for the tests of models/llama
// (stage_fixture.hpp).
#pragma once

#include "llama/model.hpp"
#include "llama/stage.hpp"
#include "stage_fixture.hpp"

namespace llama_fixture {

using OwnedStage = stage_fixture::OwnedStage<meshrun::llama::Llama>;
using OwnedModel = stage_fixture::OwnedModel<meshrun::llama::Llama>;

}  // namespace llama_fixture

using LlamaModel = llama_fixture::OwnedModel;

// The batch every Llama test runs: 2 sequences of 5 tokens.
constexpr int64_t kBatch = 2;
constexpr int64_t kSeqLen = 5;
