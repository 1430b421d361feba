// The model kit's composition (models/kit): compositions that do not line
// up are refused naming the op; a Qwen2-like, a Phi-like, a GPT-2-like and
// a Mixtral-like composition (every op kind, every bias, a parallel block,
// partial rotary, a final LayerNorm, lm_head's bias, Conv1D projections,
// learned positions and a mixture of experts) have each parameter's
// gradient match central differences of
// their own loss (at every entry; 64 per parameter in the quick tier,
// finite_differences::checked_entries); checkpointing, pipeline stages and
// split backwards give exactly the results of the whole model.
//
// Tolerances: the gradient check differences the float32 loss (~5, rounded
// to ~5e-7) over steps of 2 x 1e-2, so ~3e-5 of noise, plus the O(eps^2)
// truncation of curvature on these tiny weights; 1e-3 absolute + 2e-2
// relative keeps a margin of ~10x on what was seen (at most 1.3e-4) and
// still catches a missing term, which is O(the gradient). Stages and
// recomputation run the same kernels on the same shapes in the same order:
// equal bit for bit. The Mixtral-like gradient check takes no
// load-balancing loss (coefficient 0): the forward returns the
// cross-entropy only; the stage checks keep it. Its routing is away from
// ties for these weights (a top-2 of 3 flip under the 1e-2 steps would
// show as a gradient mismatch, deterministically for the fixed seed).
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "finite_differences.hpp"
#include "kit/composed.hpp"
#include "kit_compositions.hpp"
#include "stage_fixture.hpp"

namespace kit_test {

using Catch::Matchers::Contains;
using meshrun::kit::Composed;
using meshrun::kit::Composition;
using meshrun::models::ParameterView;
using stage_fixture::Batch;
using stage_fixture::random_batch;
using KitModel = stage_fixture::OwnedModel<Composed>;
using Chain = stage_fixture::Chain<Composed>;

// Weights of a trained model's magnitude: norm weights around 1, biases
// and matrices far enough from 0 that every term of the backward shows.
void randomize(KitModel& model, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (ParameterView& view : model.parameters()) {
    const bool embedding =
        view.name.rfind("model.embed_tokens", 0) == 0 || view.name.rfind("transformer.w", 0) == 0;
    const bool norm_weight = view.shape.size() == 1 && view.name.ends_with("norm.weight");
    const float scale = embedding ? 1.0f : view.shape.size() == 1 ? 0.2f : 0.4f;
    for (int64_t i = 0; i < view.numel; ++i) {
      view.data[i] = (norm_weight ? 1.0f : 0.0f) + scale * normal(engine);
    }
  }
}

TEST_CASE("kit parameters: Hugging Face names in the kit's order, fused projections adjacent",
          "[kit]") {
  const auto names = [](const Composition& c) {
    std::vector<std::string> all;
    for (const ParameterView& view : meshrun::kit::parameters(c)) all.push_back(view.name);
    return all;
  };
  const std::string p = "model.layers.0.";
  CHECK(names(qwen2_like(1)) ==
        std::vector<std::string>{"model.embed_tokens.weight", p + "input_layernorm.weight",
                                 p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                 p + "self_attn.v_proj.weight", p + "self_attn.q_proj.bias",
                                 p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias",
                                 p + "self_attn.o_proj.weight",
                                 p + "post_attention_layernorm.weight", p + "mlp.gate_proj.weight",
                                 p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
                                 "model.norm.weight", "lm_head.weight"});
  const std::vector<std::string> phi = names(phi_like(1));
  CHECK(phi.back() == "lm_head.weight");
  CHECK(phi[phi.size() - 2] == "lm_head.bias");
  CHECK(std::count(phi.begin(), phi.end(), p + "self_attn.dense.bias") == 1);
  CHECK(std::count(phi.begin(), phi.end(), p + "mlp.fc1.bias") == 1);
  const std::string h = "transformer.h.0.";
  std::vector<std::string> gpt2_placements;
  for (const ParameterView& view : meshrun::kit::parameters(gpt2_like(1))) {
    gpt2_placements.push_back(view.name + " " + view.tp);
  }
  CHECK(gpt2_placements == std::vector<std::string>{
                               "transformer.wte.weight shard(0)",
                               "transformer.wpe.weight replicate", h + "ln_1.weight replicate",
                               h + "ln_1.bias replicate", h + "attn.c_attn.weight shard(1,3)",
                               h + "attn.c_attn.bias shard(0,3)", h + "attn.c_proj.weight shard(0)",
                               h + "attn.c_proj.bias replicate", h + "ln_2.weight replicate",
                               h + "ln_2.bias replicate", h + "mlp.c_fc.weight shard(1)",
                               h + "mlp.c_fc.bias shard(0)", h + "mlp.c_proj.weight shard(0)",
                               h + "mlp.c_proj.bias replicate", "transformer.ln_f.weight replicate",
                               "transformer.ln_f.bias replicate", "lm_head.weight shard(0)"});
  const Composition gpt2 = gpt2_like(1);
  CHECK(meshrun::kit::tensor_parallel_block(gpt2, h + "mlp.c_proj.weight") ==
        meshrun::models::Block::mlp);
  CHECK(meshrun::kit::tensor_parallel_block(gpt2, h + "attn.c_proj.weight") ==
        meshrun::models::Block::attention);
  CHECK(!meshrun::kit::tensor_parallel_block(gpt2, h + "ln_1.weight"));
}

// GPT-2's scaled initialization: the output projections' std is
// initializer_range / sqrt(2 layers), the others' initializer_range.
TEST_CASE("kit initialization scales the output projections when asked", "[kit]") {
  meshrun_kit_model_spec spec = gpt2_spec(8);
  spec.hidden_size = 64;
  spec.intermediate_size = 64;
  const Composition c = meshrun::kit::compose(spec, "gpt2", nlohmann::ordered_json::object());
  const std::vector<ParameterView> views = meshrun::kit::parameters(c);
  const auto std_of = [&](const std::string& name) {
    const auto found = std::find_if(views.begin(), views.end(),
                                    [&](const ParameterView& view) { return view.name == name; });
    REQUIRE(found != views.end());
    std::vector<float> values(size_t(found->numel));
    meshrun::kit::init_parameter(c, views, 3, found - views.begin(), values.data());
    double sum = 0;
    for (float v : values) sum += double(v) * v;
    return std::sqrt(sum / double(values.size()));
  };
  // 4096 draws: the sample std is within ~3% of the true one.
  CHECK(std_of("transformer.h.3.attn.c_attn.weight") == Approx(0.02).epsilon(0.06));
  CHECK(std_of("transformer.h.3.attn.c_proj.weight") == Approx(0.005).epsilon(0.06));
  CHECK(std_of("transformer.h.3.mlp.c_proj.weight") == Approx(0.005).epsilon(0.06));
  CHECK(std_of("transformer.h.3.mlp.c_fc.weight") == Approx(0.02).epsilon(0.06));
}

TEST_CASE("kit gradients of every parameter match central differences of the loss", "[kit]") {
  const Composition composition =
      GENERATE(qwen2_like(2), phi_like(2), gpt2_like(2), mixtral_like(2, 0.0));
  INFO(composition.model_type);
  KitModel model(composition);
  randomize(model, 5);
  const Batch batch = random_batch(kVocab, kBatch, kSeqLen, 6);
  model.zero_grad();
  model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  model.backward();
  for (ParameterView& view : model.parameters()) {
    std::vector<float> analytic;
    std::vector<double> numeric;
    for (const int64_t entry : finite_differences::checked_entries(view.numel)) {
      analytic.push_back(view.grad[entry]);
      numeric.push_back(finite_differences::central(view.data + entry, 1, 1e-2, [&] {
        return double(model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen));
      })[0]);
    }
    finite_differences::require_close(view.name, analytic.data(), numeric, 1e-3, 2e-2);
  }
}

// A strategy gathering in bfloat16 hands the model a bfloat16 copy of the
// weights beside the float32 ones (the same numbers): bfloat16 matmuls read
// the copy. The copied model's float32 matrices are NaN, so a loss or a
// gradient that matches the model without a copy shows that no GEMM read
// them; norms, biases and the embedding lookup still read float32.
TEST_CASE("kit bfloat16 matmuls read the weights' bfloat16 copy where the host holds one",
          "[kit][bfloat16]") {
  if (!meshrun::kernels::bfloat16_matmuls_native()) {
    WARN("no bfloat16 instructions: bfloat16 matmuls round float32 operands instead");
    return;
  }
  const Composition composition =
      GENERATE(qwen2_like(2), phi_like(2), gpt2_like(2), mixtral_like(2, 0.1));
  INFO(composition.model_type);
  const meshrun::kernels::MatmulPrecisionScope bfloat16(
      meshrun::kernels::MatmulPrecision::bfloat16);
  KitModel rounded(composition), copied(composition);
  for (KitModel* model : {&rounded, &copied}) {
    randomize(*model, 9);
    model->zero_grad();
  }
  for (ParameterView& view : rounded.parameters()) {
    for (int64_t i = 0; i < view.numel; ++i)
      view.data[i] = meshrun::rounded_to_bfloat16(view.data[i]);
  }
  copied.hold_bfloat16_copy();
  for (ParameterView& view : copied.parameters()) {
    const bool embedding =
        view.name.rfind("model.embed_tokens", 0) == 0 || view.name.rfind("transformer.w", 0) == 0;
    if (view.shape.size() == 2 && !embedding) {
      std::fill_n(view.data, view.numel, std::numeric_limits<float>::quiet_NaN());
    }
  }
  const Batch batch = random_batch(kVocab, kBatch, kSeqLen, 10);
  const float loss = rounded.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  CHECK(copied.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen) == loss);
  rounded.backward();
  copied.backward();
  CHECK(std::equal(rounded.grad_buffer(), rounded.grad_buffer() + rounded.num_parameters(),
                   copied.grad_buffer()));
}

std::vector<Batch> random_batches(int count) {
  std::vector<Batch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(random_batch(kVocab, kBatch, kSeqLen, 20 + i));
  return batches;
}

TEST_CASE("kit stages, split backwards and checkpointing give exactly the whole model's results",
          "[kit][stage]") {
  const Composition composition =
      GENERATE(qwen2_like(4), phi_like(4), gpt2_like(4), mixtral_like(4, 0.1));
  INFO(composition.model_type);
  KitModel model(composition);
  randomize(model, 8);
  const std::vector<Batch> batches = random_batches(4);
  const std::vector<meshrun::models::StageLayout> two_stages = {{0, 2, true, false},
                                                                {2, 4, false, true}};
  Chain whole(model, {{0, 4, true, true}}, kBatch, kSeqLen);
  Chain split(model, two_stages, kBatch, kSeqLen);
  CHECK(split.run("F0 F1 I0 F2 I1 W0 F3 I2 W1 W2 B3", batches, 0.25f) ==
        whole.run("F0 B0 F1 B1 F2 B2 F3 B3", batches, 0.25f));
  CHECK(split.gradients() == whole.gradients());
  stage_fixture::check_checkpointing_is_exact(model, two_stages, batches, kBatch, kSeqLen);
}

// Each malformed layer, refused when the model is made, naming the op.
TEST_CASE("kit compositions that do not line up are refused naming the op", "[kit]") {
  struct Case {
    std::vector<meshrun_kit_op> ops;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{{MESHRUN_KIT_RMSNORM, 0, "norm", "x", nullptr, "n"},
        {MESHRUN_KIT_SWIGLU_MLP, 0, "mlp", "n3", nullptr, "out"}},
       "kit: layer op 1 'mlp' reads 'n3', which no earlier op writes (written so far: x, n)"},
      {{{MESHRUN_KIT_RMSNORM, 0, "norm", "x", nullptr, "n"},
        {MESHRUN_KIT_ADD, 0, nullptr, "x", "n", "n"}},
       "kit: layer op 1 (ADD) writes 'n', which is written already"},
      {{{MESHRUN_KIT_RMSNORM, 0, "norm", "x", nullptr, "n"},
        {MESHRUN_KIT_RMSNORM, 0, "norm", "n", nullptr, "out"}},
       "kit: layer op 1 'norm' has the name of an earlier op"},
      {{{MESHRUN_KIT_RMSNORM, 0, "norm", "x", nullptr, "n"},
        {MESHRUN_KIT_ATTENTION, 0, "attn", "x", nullptr, "out"}},
       "kit: layer op 0 'norm' writes 'n', which no later op reads"},
      {{{MESHRUN_KIT_RMSNORM, 0, "norm", "x", nullptr, "n"}},
       "kit: layer op 0 'norm' is the last op and writes 'n'; the last op writes the layer's "
       "output, 'out'"},
      {{{MESHRUN_KIT_RMSNORM, MESHRUN_KIT_BIAS_IN, "norm", "x", nullptr, "out"}},
       "kit: layer op 0 'norm' has flags 1; only ATTENTION, SWIGLU_MLP and GELU_MLP take"},
      {{{MESHRUN_KIT_MOE_MLP, MESHRUN_KIT_BIAS_OUT, "moe", "x", nullptr, "out"}},
       "kit: layer op 0 'moe' has flags 2; only ATTENTION, SWIGLU_MLP and GELU_MLP take"},
      {{{MESHRUN_KIT_ADD, 0, nullptr, "x", nullptr, "out"}},
       "kit: layer op 0 (ADD) is an ADD without input2"},
      {{{9, 0, "conv", "x", nullptr, "out"}}, "kit: layer op 0 'conv' has op 9; valid:"},
      {{{MESHRUN_KIT_GELU_MLP, 0, nullptr, "x", nullptr, "out"}},
       "kit: layer op 0 (ADD) is a GELU_MLP without a name"},
  };
  for (const Case& c : cases) {
    meshrun_kit_model_spec spec = base_spec(1);
    spec.ops = c.ops.data();
    spec.num_ops = int64_t(c.ops.size());
    INFO(c.message);
    CHECK_THROWS_WITH(meshrun::kit::compose(spec, "bad", nlohmann::ordered_json::object()),
                      Contains(c.message));
  }
  meshrun_kit_model_spec odd_heads = base_spec(1);
  odd_heads.ops = kQwen2Layer;
  odd_heads.num_ops = 6;
  odd_heads.num_attention_heads = 3;
  CHECK_THROWS_WITH(
      meshrun::kit::compose(odd_heads, "bad", nlohmann::ordered_json::object()),
      Contains("model.hidden_size: 8 must be divisible by model.num_attention_heads"));
}

// Why compose refuses `spec`, or "accepted".
std::string refusal(const meshrun_kit_model_spec& spec) {
  try {
    meshrun::kit::compose(spec, "bad", nlohmann::ordered_json::object());
  } catch (const std::invalid_argument& e) {
    return std::string(e.what());
  }
  return std::string("accepted");
}

// What kit 1.1's naming and layout fields refuse.
TEST_CASE("kit refuses Conv1D projections, positions and size keys that do not fit", "[kit]") {
  meshrun_kit_model_spec swiglu = base_spec(1);
  swiglu.ops = kQwen2Layer;
  swiglu.num_ops = 6;
  swiglu.num_key_value_heads = 2;
  swiglu.projections = MESHRUN_KIT_CONV1D;
  CHECK_THAT(refusal(swiglu), Contains("kit: layer op 4 'mlp' is a SWIGLU_MLP, which "
                                       "MESHRUN_KIT_CONV1D projections do not name"));
  meshrun_kit_model_spec grouped = gpt2_spec(1);
  grouped.num_key_value_heads = 1;
  CHECK_THAT(refusal(grouped), Contains("kit: layer op 1 'attn' is an ATTENTION with grouped "
                                        "key/value heads"));
  meshrun_kit_model_spec no_rows = gpt2_spec(1);
  no_rows.max_position_embeddings = 0;
  CHECK_THAT(refusal(no_rows), Contains("kit: a learned position embedding needs "
                                        "max_position_embeddings"));
  meshrun_kit_model_spec bad_key = gpt2_spec(1);
  bad_key.size_keys = R"({"hidden": "n_embd"})";
  CHECK_THAT(refusal(bad_key), Contains("kit: size_keys names 'hidden'; valid: vocab_size"));
  meshrun_kit_model_spec bad_layout = gpt2_spec(1);
  bad_layout.projections = 7;
  CHECK_THAT(refusal(bad_layout), Contains("kit: projections must be MESHRUN_KIT_LINEAR or "
                                           "MESHRUN_KIT_CONV1D"));
  meshrun_kit_model_spec bad_name = gpt2_spec(1);
  bad_name.layers_name = "transformer/h";
  CHECK_THAT(refusal(bad_name), Contains("kit: layers_name 'transformer/h' is not a module name"));
  meshrun_kit_model_spec renamed = gpt2_spec(1);
  renamed.hidden_size = 0;
  CHECK_THAT(refusal(renamed), Contains("model.n_embd: must be positive, got 0"));
}

// What kit 1.2's mixture of experts refuses.
TEST_CASE("kit refuses mixtures of experts that do not fit", "[kit]") {
  meshrun_kit_model_spec too_many = mixtral_spec(1, 0.0);
  too_many.num_experts_per_tok = 4;
  CHECK_THAT(refusal(too_many), Contains("model.num_experts_per_tok: 4 experts per token; valid: "
                                         "1 to model.num_local_experts (3)"));
  meshrun_kit_model_spec none = mixtral_spec(1, 0.0);
  none.num_local_experts = 0;
  CHECK_THAT(refusal(none), Contains("model.num_local_experts: must be positive, got 0"));
  meshrun_kit_model_spec dense = base_spec(1);
  dense.ops = kQwen2Layer;
  dense.num_ops = 6;
  dense.num_local_experts = 4;
  CHECK_THAT(refusal(dense), Contains("kit: num_local_experts, num_experts_per_tok and "
                                      "router_aux_loss_coef are for MESHRUN_KIT_MOE_MLP ops"));
  meshrun_kit_model_spec conv1d = mixtral_spec(1, 0.0);
  conv1d.num_key_value_heads = 2;
  conv1d.projections = MESHRUN_KIT_CONV1D;
  CHECK_THAT(refusal(conv1d), Contains("kit: layer op 4 'block_sparse_moe' is a MOE_MLP, which "
                                       "MESHRUN_KIT_CONV1D projections do not name"));
  const Composition mixtral = mixtral_like(1, 0.0);
  CHECK_THAT(mixtral.sequence_parallel_refusal,
             Contains("layer op 'block_sparse_moe' is a MOE_MLP"));
  CHECK_THROWS_WITH(meshrun::kit::check_tensor_parallel(mixtral, 2, {}),
                    Contains("kit: tensor parallelism: layer op 'block_sparse_moe' is a MOE_MLP"));
  CHECK_NOTHROW(meshrun::kit::check_tensor_parallel(mixtral, 1, {}));
}

// A rank holding some experts sees the views after them where they are.
TEST_CASE("kit mixtures find their views on a rank holding some experts", "[kit]") {
  const Composition mixtral = mixtral_like(1, 0.0);
  const std::vector<ParameterView> parameters = meshrun::kit::parameters(mixtral);
  CHECK(parameters[7].name == "model.layers.0.block_sparse_moe.gate.weight");
  CHECK(parameters[7].expert == -1);
  CHECK(parameters[8].name == "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  CHECK(parameters[8].expert == 0);
  CHECK(parameters[16].name == "model.layers.0.block_sparse_moe.experts.2.w2.weight");
  CHECK(parameters[16].expert == 2);
  CHECK(parameters[17].name == "model.layers.0.post_moe_layernorm.weight");
  CHECK(mixtral.first_views(3) == std::vector<int64_t>{0, 1, 5, 5, 6, 16, 17});
  CHECK(mixtral.first_views(1) == std::vector<int64_t>{0, 1, 5, 5, 6, 10, 11});
}

}  // namespace kit_test
