// The one instantiation of the Mixtral stage.
#include "common/stage_impl.hpp"
#include "mixtral/moe.hpp"

template class meshrun::models::TransformerStage<meshrun::mixtral::Mixtral>;
