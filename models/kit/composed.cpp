#include "kit/composed.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/stage_impl.hpp"
#include "common/support.hpp"

template class meshrun::models::TransformerStage<meshrun::kit::Composed>;

namespace meshrun::kit {

using namespace kernels;
using models::bytes_of;
using models::LinearWeight;
using models::weight_of;
using models::WeightLayout;

namespace {

// The projections' weights in the composition's layout: torch.nn.Linear's
// [out, in] or Conv1D's [in, out].
WeightLayout layout_of(const Composition& c) {
  return c.conv1d ? WeightLayout::in_out : WeightLayout::out_in;
}

std::vector<int64_t> rotary_positions(const Composition& c,
                                      const models::SequenceAttention& attend) {
  return c.learned_positions() ? std::vector<int64_t>{} : attend.positions();
}

}  // namespace

Pass::Pass(const Composition& c, int64_t batch, int64_t seq_len, TensorParallelGroup& tp,
           bool sequence_parallel, const models::ParallelBlocks& blocks,
           const models::ContextParallel& cp, const models::ExpertParallel& ep,
           models::Compute& compute)
    : composition(c),
      compute(compute),
      tp(tp),
      replicated(tp, compute),
      blocks(blocks),
      sequence_parallel(sequence_parallel),
      attention{batch, seq_len, blocks.local(Block::attention, c.num_attention_heads, tp),
                blocks.local(Block::attention, c.num_key_value_heads, tp), c.head_dim()},
      hidden(c.hidden_size),
      intermediate(blocks.local(Block::mlp, c.intermediate_size, tp)),
      embedding_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::embedding)),
      head_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::head)),
      attend(attention, cp, Composed::kName, compute),
      rotary(attention.head_dim, rotary_positions(c, attend), c.rope_theta, c.rotary_dim()),
      rotation(compute.rotation(rotary)),
      d_qkv(size_t(rows() * attention.qkv_dim()), compute),
      d_attention(size_t(rows() * attention.q_dim()), compute),
      d_hidden(size_t(rows() * 2 * intermediate), compute),
      d_act(size_t(rows() * intermediate), compute),
      d_norm(size_t(rows() * hidden), compute) {
  models::require(!sequence_parallel || c.sequence_parallel_refusal.empty(), Composed::kName,
                  "sequence parallelism: " + c.sequence_parallel_refusal);
  models::require(!sequence_parallel || rows() % tp.size() == 0, Composed::kName,
                  "sequence parallelism shards the " + std::to_string(rows()) +
                      " rows of a micro-batch over " + std::to_string(tp.size()) +
                      " tp ranks, which do not divide them");
  if (c.learned_positions()) {
    const int64_t sequence = seq_len * cp.size();
    models::require(sequence <= c.max_position_embeddings, Composed::kName,
                    "seq_len " + std::to_string(sequence) + " is beyond " +
                        c.size_name("max_position_embeddings") + " " +
                        std::to_string(c.max_position_embeddings) + " (" + c.position_weight() +
                        " has a row per position)");
    const std::vector<int64_t>& in_sequence = attend.positions();
    std::vector<int32_t> of_rows(static_cast<size_t>(rows()));
    for (int64_t r = 0; r < rows(); ++r)
      of_rows[size_t(r)] = int32_t(in_sequence[size_t(r % seq_len)]);
    positions.resize(of_rows.size());
    compute.copy_from_host(positions.data(), of_rows.data(), bytes_of(of_rows));
    projection.resize(size_t(rows() * hidden));
  }
  d_residual.resize(size_t(stream_numel()));
  if (sequence_parallel) {
    stream.resize(size_t(stream_numel()));
    projection.resize(size_t(rows() * hidden));
    d_gathered.resize(size_t(rows() * hidden));
    d_norm_weight.resize(size_t(hidden));
    d_norm_bias.resize(size_t(hidden));
  }
  for (size_t t = 0; t < c.tensors.size(); ++t) transient.emplace_back(compute);
  for (const LayerOp& op : c.ops) {
    if (!op.keeps_output) {
      transient[size_t(op.output)].resize(size_t(stream_numel()));
    }
  }
  if (c.moe_ops() > 0) {
    experts = std::make_unique<models::MixtureScratch>(
        models::MixtureShape{rows(), hidden, c.intermediate_size, c.num_local_experts,
                             c.num_experts_per_tok, c.num_hidden_layers, c.router_aux_loss_coef},
        ep, Composed::kName, compute);
  }
  first_view = c.first_views(experts ? experts->local_experts : c.num_local_experts);
}

Floats Pass::take() {
  if (spare.empty()) return Floats(size_t(stream_numel()), compute);
  Floats buffer = std::move(spare.back());
  spare.pop_back();
  return buffer;
}

Floats Pass::take_zeroed() {
  Floats buffer = take();
  compute.zero(buffer.data(), int64_t(buffer.size()));
  return buffer;
}

void Pass::give(Floats&& buffer) { spare.push_back(std::move(buffer)); }

LayerActivations::LayerActivations(const Pass& pass) : composition(&pass.composition) {
  for (size_t t = 0; t < pass.composition.tensors.size(); ++t) tensors.emplace_back(pass.compute);
  for (size_t i = 0; i < pass.composition.ops.size(); ++i) ops.emplace_back(pass.compute);
  const auto N = size_t(pass.rows()), I = size_t(pass.intermediate);
  const auto n = size_t(pass.stream_rows());
  const kernels::AttentionShape& shape = pass.attention;
  for (size_t i = 0; i < ops.size(); ++i) {
    const LayerOp& op = composition->ops[i];
    OpActivations& kept = ops[i];
    if (op.keeps_output) tensors[size_t(op.output)].resize(size_t(pass.numel_of(op)));
    if (is_norm(op.op)) kept.rstd.resize(n);
    if (op.op == Op::layernorm) kept.mean.resize(n);
    if (op.op == Op::attention) {
      kept.qkv.resize(N * size_t(shape.qkv_dim()));
      kept.lse.resize(size_t(shape.lse_size()));
      kept.attention.resize(N * size_t(shape.q_dim()));
    }
    if (is_mlp(op.op)) {
      kept.hidden.resize(N * I * (op.op == Op::swiglu_mlp ? 2 : 1));
      kept.act.resize(N * I);
    }
    if (op.op == Op::moe_mlp) kept.experts.emplace(*pass.experts);
  }
}

int64_t LayerActivations::bytes() const {
  int64_t total = 0;
  for (const auto& tensor : tensors) total += bytes_of(tensor);
  for (const OpActivations& kept : ops) {
    total +=
        bytes_of(kept.rstd, kept.mean, kept.qkv, kept.lse, kept.attention, kept.hidden, kept.act);
    if (kept.experts) total += kept.experts->bytes();
  }
  return total;
}

HeadActivations::HeadActivations(const Pass& pass)
    : norm(size_t(pass.rows() * pass.hidden), pass.compute),
      rstd(size_t(pass.stream_rows()), pass.compute),
      mean(pass.composition.final_norm == Op::layernorm ? size_t(pass.stream_rows()) : 0,
           pass.compute),
      logits(size_t(pass.rows() * pass.head_vocab.size), pass.compute) {}

int64_t HeadActivations::bytes() const { return bytes_of(norm, rstd, mean, logits); }

namespace {

// The views of an op's fused input projection: its weights, its biases,
// the output projection's weight and bias (of views past `views` if none).
struct Projections {
  int64_t inputs;  // q, k, v: 3; gate, up: 2; fc1 or a fused Conv1D: 1
  const ParameterView* views;
  const LayerOp& op;
  WeightLayout layout;
  const ParameterView& in_weight() const { return views[0]; }
  const ParameterView& in_bias() const { return views[inputs]; }
  const ParameterView& out_weight() const { return views[inputs * (op.bias_in ? 2 : 1)]; }
  const ParameterView& out_bias() const { return (&out_weight())[1]; }
};

// The rank's views of op `op` in a layer's.
const ParameterView* views_of(const Pass& pass, const ParameterView* layer, const LayerOp& op) {
  return layer + pass.first_view[size_t(&op - pass.composition.ops.data())];
}

Projections projections(const Pass& pass, const ParameterView* layer, const LayerOp& op) {
  const int64_t fused = op.op == Op::attention ? 3 : op.op == Op::swiglu_mlp ? 2 : 1;
  const Composition& c = pass.composition;
  return {c.conv1d ? 1 : fused, views_of(pass, layer, op), op, layout_of(c)};
}

// A norm of the stream's rows. Selective checkpointing computes it again in
// the backward: one compute's kernel gives the same bits both times.
void norm_of_rows(float* y, float* mean, float* rstd, const float* x, const ParameterView* views,
                  Op op, Pass& pass) {
  const double eps = pass.composition.norm_eps;
  if (op == Op::rmsnorm) {
    pass.compute.rmsnorm_forward(y, rstd, x, views[0].data, pass.stream_rows(), pass.hidden, eps);
  } else {
    pass.compute.layernorm_forward(y, mean, rstd, x, views[0].data, views[1].data,
                                   pass.stream_rows(), pass.hidden, eps);
  }
}

// A norm on the stream's rows into y; with sequence parallelism, when an
// attention or MLP reads it, first into the pass's rows and gathered.
void norm_forward(Pass& pass, float* y, OpActivations& kept, const float* x,
                  const ParameterView* views, const LayerOp& op) {
  const bool gather = pass.sequence_parallel && op.gathered_output;
  float* rows = gather ? pass.stream.data() : y;
  norm_of_rows(rows, kept.mean.data(), kept.rstd.data(), x, views, op.op, pass);
  if (gather) models::gather_rows(pass.tp, rows, y, pass.stream_rows(), pass.hidden);
}

// The norm's backward on the stream's rows: dx += through the norm; with
// sequence parallelism each rank has its rows' share of the weight's (and
// bias's) gradient, which is summed over tp.
void norm_weights_backward(Pass& pass, Op op, const ParameterView* views, float* dx,
                           const float* dy, const float* x, const float* mean, const float* rstd,
                           WeightGradients& gradients) {
  const int64_t n = pass.stream_rows(), H = pass.hidden;
  const bool shared = pass.sequence_parallel;
  float* d_weight = shared ? pass.d_norm_weight.data() : views[0].grad;
  float* d_bias =
      shared ? pass.d_norm_bias.data() : (op == Op::layernorm ? views[1].grad : nullptr);
  if (shared) {
    pass.compute.zero(pass.d_norm_weight.data(), H);
    pass.compute.zero(pass.d_norm_bias.data(), H);
  }
  if (op == Op::rmsnorm) {
    pass.compute.rmsnorm_backward(dx, d_weight, dy, x, views[0].data, rstd, n, H);
  } else {
    pass.compute.layernorm_backward(dx, d_weight, d_bias, dy, x, views[0].data, mean, rstd, n, H);
  }
  const int64_t vectors = op == Op::layernorm ? 2 : 1;
  for (int64_t v = 0; v < vectors && shared; ++v) {
    float* partial = v == 0 ? d_weight : d_bias;
    pass.tp.all_reduce_sum(partial, H);
    pass.compute.accumulate(views[v].grad, partial, H);
  }
  for (int64_t v = vectors - 1; v >= 0; --v) gradients.vector_ready(views[v]);
}

void activation_forward(OpActivations& kept, const LayerOp& op, Pass& pass) {
  if (op.op == Op::swiglu_mlp) {
    pass.compute.swiglu_forward(kept.act.data(), kept.hidden.data(), pass.rows(),
                                pass.intermediate);
  } else {
    pass.compute.gelu_forward(kept.act.data(), kept.hidden.data(), pass.rows() * pass.intermediate);
  }
}

// Where a layer's tensors are: its input, the caller's output, what the
// activations keep, the pass's scratch.
struct Tensors {
  Pass& pass;
  LayerActivations& saved;
  const float* x;
  float* out;
  float* operator[](int tensor) const {
    if (tensor == 0) return const_cast<float*>(x);
    if (tensor + 1 == int(saved.tensors.size())) return out;
    Floats& kept = saved.tensors[size_t(tensor)];
    return kept.empty() ? pass.transient[size_t(tensor)].data() : kept.data();
  }
};

// y = the row-parallel output projection of x [rows, width], summed over
// the block's group: all of it, or the rank's rows (sequence parallel);
// then its bias.
void output_projection(Pass& pass, const Projections& p, Block block, const float* x, int64_t width,
                       float* y) {
  const int64_t N = pass.rows(), H = pass.hidden;
  TensorParallelGroup& group = pass.group(block);
  float* full = pass.sequence_parallel ? pass.projection.data() : y;
  pass.compute.linear_forward(p.layout, full, x, weight_of(p.out_weight()), N, width, H);
  if (!pass.sequence_parallel) {
    models::reduce_partial_sums(group, y, N * H);
  } else {
    models::reduce_scatter_rows(group, full, y, pass.stream_rows(), H);
  }
  if (p.op.bias_out) pass.compute.bias_forward(y, p.out_bias().data, pass.stream_rows(), H);
}

void attention_forward(Pass& pass, const Projections& p, const float* in, OpActivations& kept,
                       float* y) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden;
  pass.compute.linear_forward(p.layout, kept.qkv.data(), in, weight_of(p.in_weight()), N, H,
                              shape.qkv_dim());
  if (p.op.bias_in) {
    pass.compute.bias_forward(kept.qkv.data(), p.in_bias().data, N, shape.qkv_dim());
  }
  if (!pass.composition.learned_positions()) {
    pass.rotation->forward(kept.qkv.data(), shape.batch, shape.seq_len,
                           shape.heads + shape.kv_heads, shape.qkv_dim());
  }
  pass.attend.forward(kept.attention.data(), kept.lse.data(), kept.qkv.data());
  output_projection(pass, p, Block::attention, kept.attention.data(), shape.q_dim(), y);
}

void mlp_forward(Pass& pass, const Projections& p, const float* in, OpActivations& kept, float* y) {
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate;
  const int64_t width = p.inputs * I;
  pass.compute.linear_forward(p.layout, kept.hidden.data(), in, weight_of(p.in_weight()), N, H,
                              width);
  if (p.op.bias_in) pass.compute.bias_forward(kept.hidden.data(), p.in_bias().data, N, width);
  models::round_kept(pass.bfloat16_activations, kept.hidden, pass.compute);
  activation_forward(kept, p.op, pass);
  output_projection(pass, p, Block::mlp, kept.act.data(), I, y);
}

// The gradients of a layer's tensors during its backward: a buffer each,
// empty until something flows into it.
struct Gradients {
  Pass& pass;
  std::vector<Floats> of;

  // Adds `buffer` into tensor t's gradient, taking the buffer when it has none.
  void add(int t, Floats&& buffer) {
    Floats& g = of[size_t(t)];
    if (g.empty()) {
      g = std::move(buffer);
      return;
    }
    pass.compute.accumulate(g.data(), buffer.data(), int64_t(g.size()));
    pass.give(std::move(buffer));
  }
  void add_copy(int t, const Floats& values) {
    Floats copy = pass.take();
    pass.compute.copy(copy.data(), values.data(), int64_t(values.size()));
    add(t, std::move(copy));
  }
  Floats& accumulating(int t) {
    if (of[size_t(t)].empty()) of[size_t(t)] = pass.take_zeroed();
    return of[size_t(t)];
  }
};

// The input of an op's fused projection (or router), as the weight
// gradient receives it (which may move it away): the kept tensor itself
// when this op is its last reader in the backward, else a copy in `own`.
Floats& weight_gradient_input(const LayerOp& op, const Tensors& tensors, Floats& own) {
  if (op.input != 0 && op.last_input_reader) return tensors.saved.tensors[size_t(op.input)];
  const Pass& pass = tensors.pass;
  const int64_t numel = op.input == 0 ? pass.stream_numel()
                                      : pass.numel_of(pass.composition.ops[size_t(op.input - 1)]);
  own.resize(size_t(numel));
  tensors.pass.compute.copy(own.data(), tensors[op.input], numel);
  return own;
}

// The gradient of an attention's or MLP's output [rows, hidden], from its
// stream's gradient: gathered from the ranks' rows with sequence
// parallelism.
const float* block_output_gradient(Pass& pass, const Floats& dy) {
  if (!pass.sequence_parallel) return dy.data();
  models::gather_rows(pass.tp, dy.data(), pass.d_gathered.data(), pass.stream_rows(), pass.hidden);
  return pass.d_gathered.data();
}

// Computes the input gradient of the fused projection from dy (width
// columns), summed over the block's group (or reduce-scattered to the
// stream's rows, sequence parallel) while its weight gradient is
// computed, and adds it to the op's input's gradient.
void projection_input_backward(Pass& pass, const Projections& p, Block block, float* dy,
                               int64_t width, const Tensors& tensors, Gradients& grads,
                               WeightGradients& gradients) {
  const int64_t N = pass.rows(), H = pass.hidden;
  Floats d_input = pass.take();
  float* full = pass.sequence_parallel ? pass.projection.data() : d_input.data();
  pass.compute.linear_backward_input(p.layout, full, dy, weight_of(p.in_weight()), N, H, width);
  TensorParallelGroup& group = pass.group(block);
  if (pass.sequence_parallel) {
    group.start_reduce_scatter_sum(full, d_input.data(), pass.stream_numel());
  } else if (group.size() > 1) {
    group.start_all_reduce_sum(full, N * H);
  }
  Floats own(pass.compute);
  Floats& x = weight_gradient_input(p.op, tensors, own);
  gradients.linear(
      {&p.in_weight(), &p.in_weight() + p.inputs - 1, p.layout, N, H, width, &pass.compute}, dy, x);
  group.wait_started();
  grads.add(p.op.input, std::move(d_input));
}

void output_bias_backward(Pass& pass, const Projections& p, const float* dy,
                          WeightGradients& gradients) {
  if (!p.op.bias_out) return;
  pass.compute.bias_backward(p.out_bias().grad, dy, pass.rows(), pass.hidden);
  gradients.vector_ready(p.out_bias());
}

void input_bias_backward(Pass& pass, const Projections& p, const float* dy, int64_t width,
                         WeightGradients& gradients) {
  if (!p.op.bias_in) return;
  pass.compute.bias_backward(p.in_bias().grad, dy, pass.rows(), width);
  for (int64_t k = p.inputs - 1; k >= 0; --k) gradients.vector_ready((&p.in_bias())[k]);
}

void attention_backward(Pass& pass, const Projections& p, Floats& dy, OpActivations& kept,
                        const Tensors& tensors, Gradients& grads, WeightGradients& gradients) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden, Q = shape.q_dim();
  const float* d_out = block_output_gradient(pass, dy);
  pass.compute.linear_backward_input(p.layout, pass.d_attention.data(), d_out,
                                     weight_of(p.out_weight()), N, Q, H);
  pass.attend.backward(pass.d_qkv.data(), pass.d_attention.data(), kept.qkv.data(),
                       kept.attention.data(), kept.lse.data());
  gradients.linear({&p.out_weight(), &p.out_weight(), p.layout, N, Q, H, &pass.compute}, d_out,
                   kept.attention);
  output_bias_backward(pass, p, d_out, gradients);
  if (!pass.composition.learned_positions()) {
    pass.rotation->backward(pass.d_qkv.data(), shape.batch, shape.seq_len,
                            shape.heads + shape.kv_heads, shape.qkv_dim());
  }
  input_bias_backward(pass, p, pass.d_qkv.data(), shape.qkv_dim(), gradients);
  projection_input_backward(pass, p, Block::attention, pass.d_qkv.data(), shape.qkv_dim(), tensors,
                            grads, gradients);
}

// d_act = dy down^T; through the activation into d_hidden; then as the
// attention's input projection.
void mlp_backward(Pass& pass, const Projections& p, Floats& dy, OpActivations& kept,
                  const Tensors& tensors, Gradients& grads, WeightGradients& gradients) {
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate;
  const float* d_out = block_output_gradient(pass, dy);
  pass.compute.linear_backward_input(p.layout, pass.d_act.data(), d_out, weight_of(p.out_weight()),
                                     N, I, H);
  gradients.linear({&p.out_weight(), &p.out_weight(), p.layout, N, I, H, &pass.compute}, d_out,
                   kept.act);
  output_bias_backward(pass, p, d_out, gradients);
  if (p.op.op == Op::swiglu_mlp) {
    pass.compute.swiglu_backward(pass.d_hidden.data(), pass.d_act.data(), kept.hidden.data(), N, I);
  } else {
    pass.compute.gelu_backward(pass.d_hidden.data(), pass.d_act.data(), kept.hidden.data(), N * I);
  }
  input_bias_backward(pass, p, pass.d_hidden.data(), p.inputs * I, gradients);
  projection_input_backward(pass, p, Block::mlp, pass.d_hidden.data(), p.inputs * I, tensors, grads,
                            gradients);
}

// The mixture's input gradient from dy, into the gradient of its input;
// the router's weight gradient reads the input's kept values.
void moe_backward(Pass& pass, const ParameterView* views, const LayerOp& op, Floats& dy,
                  OpActivations& kept, const Tensors& tensors, Gradients& grads,
                  WeightGradients& gradients) {
  Floats d_input = pass.take();
  Floats own(pass.compute);
  Floats& x = weight_gradient_input(op, tensors, own);
  models::mixture_backward(*pass.experts, views, dy.data(), pass.loss_scale, *kept.experts, x,
                           d_input.data(), gradients);
  grads.add(op.input, std::move(d_input));
}

}  // namespace

// A fused projection's views follow one another in parameter order; the
// host must lay them out so too (meshrun/model.h).
void Composed::check_layer_storage(std::span<const ParameterView> layer, bool backward) {
  const auto ends_with = [](const std::string& name, const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  for (size_t i = 0; i < layer.size(); ++i) {
    const std::string& name = layer[i].name;
    const size_t fused = ends_with(name, "q_proj.weight") || ends_with(name, "q_proj.bias") ? 3
                         : ends_with(name, "gate_proj.weight") ||
                                 ends_with(name, "gate_proj.bias") || ends_with(name, ".w1.weight")
                             ? 2
                             : 1;
    if (fused > 1 && !models::adjacent_views(&layer[i], &layer[i + fused - 1], backward)) {
      throw std::invalid_argument("kit: the host gave " + name +
                                  " and the projections fused with it storage that is not one "
                                  "block in parameter order");
    }
  }
}

// out = embed_tokens[tokens] (+ wpe[positions]) on the stream's rows.
void Composed::embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                                 float* out) {
  models::embedding_into_stream(out, pass.projection.data(), tokens, embedding[0].data, pass.rows(),
                                pass.hidden, pass.embedding_vocab, pass.group(Block::embedding),
                                pass.sequence_parallel, pass.compute);
  if (!pass.composition.learned_positions()) return;
  const int64_t first = pass.sequence_parallel ? pass.tp.rank() * pass.stream_rows() : 0;
  pass.compute.embedding_forward(pass.projection.data(), pass.positions.data() + first,
                                 embedding[1].data, pass.stream_rows(), pass.hidden, 0,
                                 pass.composition.max_position_embeddings);
  pass.compute.add(out, out, pass.projection.data(), pass.stream_numel());
}

// The position table's gradient from every row, so that each tp rank holds
// all of it (the table is replicated).
void Composed::embedding_backward(Pass& pass, const ParameterView* embedding,
                                  const int32_t* tokens) {
  const float* dy = block_output_gradient(pass, pass.d_residual);
  models::vocab_parallel_embedding_backward(embedding[0].grad, tokens, dy, pass.rows(), pass.hidden,
                                            pass.embedding_vocab, pass.compute);
  if (pass.composition.learned_positions()) {
    pass.compute.embedding_backward(embedding[1].grad, pass.positions.data(), dy, pass.rows(),
                                    pass.hidden, 0, pass.composition.max_position_embeddings);
  }
}

void Composed::layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, float* out) {
  const Tensors tensors{pass, saved, x, out};
  const std::vector<LayerOp>& ops = pass.composition.ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    const LayerOp& op = ops[i];
    OpActivations& kept = saved.ops[i];
    float* y = tensors[op.output];
    if (is_norm(op.op)) {
      norm_forward(pass, y, kept, tensors[op.input], views_of(pass, layer, op), op);
    } else if (op.op == Op::attention) {
      attention_forward(pass, projections(pass, layer, op), tensors[op.input], kept, y);
    } else if (is_mlp(op.op)) {
      mlp_forward(pass, projections(pass, layer, op), tensors[op.input], kept, y);
    } else if (op.op == Op::moe_mlp) {
      models::mixture_forward(*pass.experts, views_of(pass, layer, op), tensors[op.input],
                              *kept.experts, y);
    } else {
      pass.compute.add(y, tensors[op.input], tensors[op.input2], pass.stream_numel());
    }
    // A norm may read it next, and selective checkpointing recomputes the
    // norm from what is kept.
    if (op.keeps_output && !is_norm(op.op)) {
      models::round_kept(pass.bfloat16_activations, saved.tensors[size_t(op.output)], pass.compute);
    }
  }
}

// On entry pass.d_residual holds dL/d(out); on exit dL/dx.
void Composed::layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                              LayerActivations& saved, WeightGradients& gradients) {
  const Tensors tensors{pass, saved, x, nullptr};
  const std::vector<LayerOp>& ops = pass.composition.ops;
  Gradients grads{pass, std::vector<Floats>(saved.tensors.size())};
  grads.of.back() = std::move(pass.d_residual);
  for (size_t i = ops.size(); i-- > 0;) {
    const LayerOp& op = ops[i];
    Floats dy = std::move(grads.of[size_t(op.output)]);
    if (is_norm(op.op)) {
      const OpActivations& kept = saved.ops[i];
      norm_weights_backward(pass, op.op, views_of(pass, layer, op),
                            grads.accumulating(op.input).data(), dy.data(), tensors[op.input],
                            kept.mean.data(), kept.rstd.data(), gradients);
    } else if (op.op == Op::attention) {
      attention_backward(pass, projections(pass, layer, op), dy, saved.ops[i], tensors, grads,
                         gradients);
    } else if (is_mlp(op.op)) {
      mlp_backward(pass, projections(pass, layer, op), dy, saved.ops[i], tensors, grads, gradients);
    } else if (op.op == Op::moe_mlp) {
      moe_backward(pass, views_of(pass, layer, op), op, dy, saved.ops[i], tensors, grads,
                   gradients);
    } else {
      grads.add_copy(op.input2, dy);
      grads.add(op.input, std::move(dy));
      continue;
    }
    pass.give(std::move(dy));
  }
  pass.d_residual = std::move(grads.of.front());
}

std::vector<Floats*> Composed::elementwise(LayerActivations& saved) {
  std::vector<Floats*> buffers;
  const std::vector<LayerOp>& ops = saved.composition->ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    const LayerOp& op = ops[i];
    OpActivations& kept = saved.ops[i];
    if (is_norm(op.op)) {
      if (op.keeps_output) buffers.push_back(&saved.tensors[size_t(op.output)]);
      buffers.push_back(&kept.rstd);
      if (op.op == Op::layernorm) buffers.push_back(&kept.mean);
    }
    if (is_mlp(op.op)) buffers.push_back(&kept.act);
  }
  return buffers;
}

models::LowPrecisionBuffers Composed::low_precision(LayerActivations& saved) {
  models::LowPrecisionBuffers buffers;
  const std::vector<LayerOp>& ops = saved.composition->ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    OpActivations& kept = saved.ops[i];
    if (ops[i].keeps_output) buffers.push_back(&saved.tensors[size_t(ops[i].output)]);
    if (ops[i].op == Op::attention) buffers.insert(buffers.end(), {&kept.qkv, &kept.attention});
    if (is_mlp(ops[i].op)) buffers.insert(buffers.end(), {&kept.hidden, &kept.act});
    if (kept.experts) {
      const models::LowPrecisionBuffers experts = models::low_precision(*kept.experts);
      buffers.insert(buffers.end(), experts.begin(), experts.end());
    }
  }
  return buffers;
}

void Composed::recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                     LayerActivations& saved) {
  const Tensors tensors{pass, saved, x, pass.transient.back().data()};
  const std::vector<LayerOp>& ops = pass.composition.ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    const LayerOp& op = ops[i];
    if (is_norm(op.op)) {
      norm_forward(pass, tensors[op.output], saved.ops[i], tensors[op.input],
                   views_of(pass, layer, op), op);
    } else if (is_mlp(op.op)) {
      activation_forward(saved.ops[i], op, pass);
    }
  }
}

double Composed::head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                              const float* x, const int32_t* targets, HeadActivations& saved) {
  const Composition& c = pass.composition;
  const int64_t N = pass.rows(), H = pass.hidden, V = pass.head_vocab.size;
  const bool gather = pass.sequence_parallel;
  float* rows = gather ? pass.stream.data() : saved.norm.data();
  norm_of_rows(rows, saved.mean.data(), saved.rstd.data(), x, head, c.final_norm, pass);
  if (gather) models::gather_rows(pass.tp, rows, saved.norm.data(), pass.stream_rows(), H);
  TensorParallelGroup& group = pass.group(Block::head);
  if (!c.lm_head_bias) {
    return models::lm_head_loss_forward(saved.logits.data(), saved.norm.data(), lm_head, targets, N,
                                        H, pass.head_vocab, group, pass.compute);
  }
  pass.compute.linear_forward(WeightLayout::out_in, saved.logits.data(), saved.norm.data(),
                              weight_of(lm_head), N, H, V);
  pass.compute.bias_forward(saved.logits.data(), head[c.final_norm_views()].data, N, V);
  return models::vocab_parallel_cross_entropy_forward(saved.logits.data(), targets, N,
                                                      pass.head_vocab, group, pass.compute);
}

void Composed::head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                             const float* x, const int32_t* targets, float loss_scale,
                             HeadActivations& saved, WeightGradients& gradients) {
  const Composition& c = pass.composition;
  const int64_t N = pass.rows(), H = pass.hidden, V = pass.head_vocab.size;
  Floats& d_norm = pass.d_norm;
  if (!c.lm_head_bias) {
    models::lm_head_loss_backward(d_norm.data(), saved.logits.data(), lm_head, saved.norm, targets,
                                  loss_scale, N, H, pass.head_vocab, gradients, pass.compute);
  } else {
    const ParameterView& bias = head[c.final_norm_views()];
    models::vocab_parallel_cross_entropy_backward(saved.logits.data(), targets, N, pass.head_vocab,
                                                  loss_scale, pass.compute);
    pass.compute.bias_backward(bias.grad, saved.logits.data(), N, V);
    gradients.vector_ready(bias);
    pass.compute.linear_backward_input(WeightLayout::out_in, d_norm.data(), saved.logits.data(),
                                       weight_of(lm_head), N, H, V);
    gradients.linear({&lm_head, &lm_head, WeightLayout::out_in, N, H, V, &pass.compute},
                     saved.logits.data(), saved.norm);
  }
  TensorParallelGroup& group = pass.group(Block::head);
  const float* dy = d_norm.data();
  if (pass.sequence_parallel) {
    group.reduce_scatter_sum(d_norm.data(), pass.stream.data(), pass.stream_numel());
    dy = pass.stream.data();
  } else {
    models::reduce_partial_sums(group, d_norm.data(), N * H);
  }
  pass.d_residual.resize(size_t(pass.stream_numel()));
  pass.compute.zero(pass.d_residual.data(), pass.stream_numel());
  norm_weights_backward(pass, c.final_norm, head, pass.d_residual.data(), dy, x, saved.mean.data(),
                        saved.rstd.data(), gradients);
}

}  // namespace meshrun::kit
