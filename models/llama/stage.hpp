// A stage of the Llama model (common/stage.hpp): a contiguous range of
// decoder layers, with the embedding on the first stage and the final norm,
// lm_head and loss on the last; the whole model is the stage that holds
// everything. Its parameters in the stage's order: model.embed_tokens.weight
// (embedding); the layers' tensors; model.norm.weight and lm_head.weight
// unless tied (head).
#pragma once

#include "common/stage.hpp"
#include "llama/decoder.hpp"

namespace meshrun::llama {

using models::StageHooks;
using models::StageLayout;
using LlamaStage = models::TransformerStage<Llama>;

}  // namespace meshrun::llama

extern template class meshrun::models::TransformerStage<meshrun::llama::Llama>;
