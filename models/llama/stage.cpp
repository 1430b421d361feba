#include "llama/stage.hpp"

#include "common/stage_impl.hpp"

template class meshrun::models::TransformerStage<meshrun::llama::Llama>;
