// The traced Linear and LayerNorm+Linear ops with their C++ autograd (torch.compile's training graphs).
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// The Python route's Linear backward (ops/layernorm_linear/), so that both routes run the same GEMMs, and
// traced_linear's autograd formula: [dxn, dweight] and, with bias_grad, dbias. Without weight_grad (a frozen
// weight) dW's GEMM does not run and dweight is empty ([0]).
std::vector<Tensor> linear_grads_op(const Tensor& dy, const Tensor& xn, const Tensor& w, bool bias_grad,
                                    bool weight_grad) {
  auto [dxn, dw, db] = linear_grads(dy.contiguous(), xn.contiguous(), w, weight_grad, bias_grad);
  if (!weight_grad) dw = w.new_empty({0});
  if (bias_grad) return {dxn, dw, db};
  return {dxn, dw};
}

// The op linear_grads through the dispatcher, so that AOTAutograd records it in a backward graph.
std::vector<Tensor> linear_grads_call(const Tensor& dy, const Tensor& xn, const Tensor& w, bool bias_grad,
                                      bool weight_grad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mojo_direct::linear_grads", "")
                             .typed<std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, bool, bool)>();
  return op.call(dy, xn, w, bias_grad, weight_grad);
}

// What a traced autograd kernel's backward makes for its Linear: the weight's gradient where the weight wants one,
// the bias' where there is a bias that wants one (needs_input_grad at the weight's and the bias' places).
struct LinearWants {
  bool weight, bias;
  LinearWants(AutogradContext* ctx, size_t weight_at)
      : weight(ctx->needs_input_grad(weight_at)),
        bias(ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(weight_at + 1)) {}
  Tensor weight_grad(const Tensor& g) const { return weight ? g : Tensor(); }
};

// traced_linear's autograd kernel: linear's forward below autograd, its backward the linear_grads op, each called
// through the dispatcher, so that AOTAutograd records both in torch.compile's graphs and the compiled code calls
// them with no Python in between.
struct TracedLinearFn : public torch::autograd::Function<TracedLinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mojo_direct::traced_linear", "")
                               .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>();
    ctx->save_for_backward({xn, w});
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(xn, w, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const LinearWants wants(ctx, 1);
    std::vector<Tensor> g = linear_grads_call(grads[0], s[0], s[1], wants.bias, wants.weight);
    return {g[0], wants.weight_grad(g[1]), wants.bias ? g[2] : Tensor()};
  }
};

Tensor traced_linear(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias) {
  return TracedLinearFn::apply(xn, w, bias);
}

// dh = GELU'(h) dy for the GELU our GEMMs' epilogue applies (cuBLASLt's: the tanh form), by torch's gelu_backward.
Tensor tanh_gelu_backward(const Tensor& dy, const Tensor& h) {
  return at::gelu_backward(dy, h, "tanh");
}

// traced_linear_gelu's autograd formula: from dy and GELU's input h, dh = GELU'(h) dy, then linear_grads' GEMMs
// (db in dW's epilogue).
std::vector<Tensor> linear_gelu_grads_op(const Tensor& dy, const Tensor& xn, const Tensor& w, const Tensor& h,
                                         bool bias_grad, bool weight_grad) {
  return linear_grads_op(tanh_gelu_backward(dy, h), xn, w, bias_grad, weight_grad);
}

// gelu(linear(xn, W, bias), approximate="tanh") for torch.compile's training graphs (ops/layernorm_linear/inductor.py
// puts it in place of traced_linear and the GELU): the forward one GEMM that writes GELU's output and input (the
// op linear_gelu_aux), each through the dispatcher, as TracedLinearFn's. The backward: with bias_grad_in_gemm, the
// op linear_gelu_grads (db in dW's epilogue); else torch's gelu_backward and sum, which inductor makes one kernel,
// then linear_grads without db (where cuBLASLt would run db as a kernel of its own: layernorm_linear_config.py).
struct TracedLinearGeluFn : public torch::autograd::Function<TracedLinearGeluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias,
                        bool bias_grad_in_gemm) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mojo_direct::linear_gelu_aux", "")
                               .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                 const std::optional<Tensor>&)>();
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["bias_grad_in_gemm"] = bias_grad_in_gemm;
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h] = op.call(xn, w, bias);
    ctx->save_for_backward({xn, w, h});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mojo_direct::linear_gelu_grads", "")
                               .typed<std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                          bool, bool)>();
    auto s = ctx->get_saved_variables();
    const LinearWants wants(ctx, 1);
    if (!wants.bias || ctx->saved_data["bias_grad_in_gemm"].toBool()) {
      std::vector<Tensor> g = op.call(grads[0], s[0], s[1], s[2], wants.bias, wants.weight);
      return {g[0], wants.weight_grad(g[1]), wants.bias ? g[2] : Tensor(), Tensor()};
    }
    Tensor dh = tanh_gelu_backward(grads[0], s[2]);
    Tensor db = dh.reshape({-1, dh.size(-1)}).sum(0);
    std::vector<Tensor> g = linear_grads_call(dh, s[0], s[1], false, wants.weight);
    return {g[0], wants.weight_grad(g[1]), db, Tensor()};
  }
};

Tensor traced_linear_gelu(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias,
                          bool bias_grad_in_gemm) {
  return TracedLinearGeluFn::apply(xn, w, bias, bias_grad_in_gemm);
}

// traced_linear_gelu below autograd: linear_gelu (bias_grad_in_gemm is the backward's).
Tensor traced_linear_gelu_forward(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias, bool) {
  return linear_gelu(xn, w, bias);
}

// traced_layernorm_linear's act codes (ops/layernorm_linear/config.py: TRACED_ACTS names them): GELU's tanh form
// in the GEMM's epilogue; GELU's erf form and ReLU by torch's op on the GEMM's rounded output, as nn.Linear followed
// by nn.GELU() or nn.ReLU() computes them.
enum TracedAct : int64_t { TRACED_NONE = 0, TRACED_GELU_TANH = 1, TRACED_GELU = 2, TRACED_RELU = 3 };

// (act(h), h) for h = xn W^T + bias: h is the activation's input the backward reads (undefined for TRACED_NONE).
std::tuple<Tensor, Tensor> traced_act(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias,
                                      int64_t act) {
  if (act == TRACED_GELU_TANH) return linear_act(xn, w, bias, ACT_GELU_AUX);
  Tensor h = std::get<0>(linear_act(xn, w, bias, ACT_NONE));
  if (act == TRACED_GELU) return {at::gelu(h), h};
  if (act == TRACED_RELU) return {at::relu(h), h};
  return {h, Tensor()};
}

// dh = act'(h) dy, as torch's autograd computes it for each act (ReLU's: dy where h > 0).
Tensor traced_act_backward(const Tensor& dy, const Tensor& h, int64_t act) {
  if (act == TRACED_GELU_TANH) return tanh_gelu_backward(dy, h);
  if (act == TRACED_GELU) return at::gelu_backward(dy, h, "none");
  if (act == TRACED_RELU) return at::threshold_backward(dy, h, 0);
  return dy;
}

// act(Linear(LayerNorm(x))) for torch.compile's training graphs (ops/layernorm_linear/'s _traced, where
// COMPILED_TRAINING_LAYERNORM_LINEAR is "ours"; act 1 from ops/layernorm_linear/inductor.py's pass) and for eager
// calls of ops.layernorm_linear.layernorm_linear_act, so that one op runs each way. The forward (y, xn, mean, rstd,
// h): our LayerNorm on CUDA (elsewhere torch's layer_norm in float32, float64 kept), then linear's GEMM and the act
// (traced_act), h the act's input (empty for act 0). mean and rstd are float32 (float64 for float64 x), shaped x's
// rows.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_linear_train_fwd(
    const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w, const std::optional<Tensor>& bias,
    double eps, int64_t act) {
  TORCH_CHECK(act >= TRACED_NONE && act <= TRACED_RELU,
              "mojo_direct: layernorm_linear_train_fwd: act is 0 to 3, got ", act);
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  Tensor xn, mean, rstd;
  if (x.is_cuda()) {
    std::tie(xn, mean, rstd) = layernorm_fwd(dense(x, lnw, lnb), lnw, lnb, eps, 0);
  } else {
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    auto [z, m, r] = at::native_layer_norm(x.to(acc), {x.size(-1)}, lnw.to(acc), lnb.to(acc), eps);
    std::tie(xn, mean, rstd) = std::make_tuple(z.to(x.scalar_type()), m, r);
  }
  auto [y, h] = traced_act(xn, w, bias, act);
  return {y, xn, mean.reshape(stat_shape), rstd.reshape(stat_shape), act != TRACED_NONE ? h : x.new_empty({0})};
}

// Its backward from dy and what the forward saved: [dx, dln_weight, dln_bias, dweight] and, with bias_grad, dbias
// (dweight empty, [0], and no dW GEMM without weight_grad). The activation's backward (traced_act_backward), the
// Linear's as linear_grads_op, then our LayerNorm backward on CUDA (torch's elsewhere).
std::vector<Tensor> layernorm_linear_grads_op(const Tensor& dy, const Tensor& x, const Tensor& xn, const Tensor& lnw,
                                              const Tensor& lnb, const Tensor& w, const Tensor& mean,
                                              const Tensor& rstd, const Tensor& h, int64_t act, bool bias_grad,
                                              bool weight_grad) {
  const std::vector<Tensor> linear = linear_grads_op(traced_act_backward(dy, h, act), xn, w, bias_grad, weight_grad);
  const Tensor& dxn = linear[0];
  Tensor dx, dlnw, dlnb;
  if (x.is_cuda()) {
    std::tie(dx, dlnw, dlnb) = layernorm_bwd(dxn, x, lnw, lnb, mean, rstd, 0);
  } else {
    const auto acc = mean.scalar_type();
    auto stat_shape = x.sizes().vec();
    stat_shape.back() = 1;
    auto [a, b, c] = at::native_layer_norm_backward(dxn.to(acc), x.to(acc), {x.size(-1)}, mean.reshape(stat_shape),
                                                   rstd.reshape(stat_shape), lnw.to(acc), lnb.to(acc),
                                                   {true, true, true});
    std::tie(dx, dlnw, dlnb) = std::make_tuple(a.to(x.scalar_type()), b.to(lnw.scalar_type()),
                                               c.to(lnb.scalar_type()));
  }
  std::vector<Tensor> grads{dx, dlnw, dlnb};
  grads.insert(grads.end(), linear.begin() + 1, linear.end());   // dweight and, with bias_grad, dbias
  return grads;
}

// traced_layernorm_linear's autograd kernel: the forward op below autograd, the backward the op
// layernorm_linear_grads, each through the dispatcher, so that AOTAutograd records one op each way.
struct TracedLayerNormLinearFn : public torch::autograd::Function<TracedLayerNormLinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                        const std::optional<Tensor>& bias, double eps, int64_t act) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mojo_direct::layernorm_linear_train_fwd", "")
                               .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
                                   const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const std::optional<Tensor>&, double, int64_t)>();
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["act"] = act;
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, xn, mean, rstd, h] = op.call(x, lnw, lnb, w, bias, eps, act);
    ctx->save_for_backward({x, xn, lnw, lnb, w, mean, rstd, h});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mojo_direct::layernorm_linear_grads", "")
                               .typed<std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, int64_t, bool, bool)>();
    auto s = ctx->get_saved_variables();
    const LinearWants wants(ctx, 3);
    std::vector<Tensor> g = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
                                    ctx->saved_data["act"].toInt(), wants.bias, wants.weight);
    return {g[0], g[1], g[2], wants.weight_grad(g[3]), wants.bias ? g[4] : Tensor(), Tensor(), Tensor()};
  }
};

Tensor traced_layernorm_linear(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                               const std::optional<Tensor>& bias, double eps, int64_t act) {
  return TracedLayerNormLinearFn::apply(x, lnw, lnb, w, bias, eps, act);
}

// traced_layernorm_linear below autograd: y.
Tensor traced_layernorm_linear_forward(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                                       const std::optional<Tensor>& bias, double eps, int64_t act) {
  return std::get<0>(layernorm_linear_train_fwd(x, lnw, lnb, w, bias, eps, act));
}

// ops.layernorm_linear.layernorm_linear_act on a GPU: traced_layernorm_linear with its autograd for a call our
// kernels take as it comes (linear_accepts, the mirror of Python's classify; the weight may be the transpose of a
// contiguous one, GPT-2's Conv1D's), or undefined for a call the Python route takes (it names what is wrong, or has
// torch's ops answer), so that the common call crosses into C++ once, with no Python checks before it.
Tensor layernorm_linear_act(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                            const std::optional<Tensor>& bias, double eps, int64_t act) {
  if (!x.is_cuda() || act < TRACED_GELU_TANH || act > TRACED_RELU ||
      !linear_accepts(x, lnw, lnb, w, bias, /*any_layout=*/true, /*transposed=*/true))
    return Tensor();
  if (!grad_to_come({&x, &lnw, &lnb, &w}) && !(bias.has_value() && grad_to_come({&*bias}))) {
    c10::DeviceGuard guard(x.device());   // no autograd node, no statistics kept
    return std::get<0>(traced_act(layernorm_infer(dense(x, lnw, lnb), lnw, lnb, eps, 0), w, bias, act));
  }
  return TracedLayerNormLinearFn::apply(x, lnw, lnb, w, bias, eps, act);
}

// ---------------------------------------------------------------- several Linears of one input

// y_i = x W_i^T + b_i for each weight of `ws` (and bias of `bs`: as many as `ws`, or none), each by linear_act's
// GEMM (cuBLASLt on a GPU, torch's ops elsewhere): traced_linears below autograd (inference mode).
std::vector<Tensor> traced_linears_forward(const Tensor& x, at::TensorList ws, at::TensorList bs) {
  TORCH_CHECK(bs.empty() || bs.size() == ws.size(), "mojo_direct: linears: as many biases as weights, or none");
  std::vector<Tensor> ys;
  for (size_t i = 0; i < ws.size(); ++i)
    ys.push_back(std::get<0>(linear_act(x, ws[i], bs.empty() ? std::optional<Tensor>() : bs[i], ACT_NONE)));
  return ys;
}

// Those Linears with autograd. The backward: each weight's and bias' gradient from its own dy, and dx the sum of
// each dy_i W_i (an output with no gradient adds nothing, and its weight and bias get none).
struct LinearsFn : public torch::autograd::Function<LinearsFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, at::TensorList ws, at::TensorList bs) {
    std::vector<Tensor> saved{x};
    saved.insert(saved.end(), ws.begin(), ws.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["biased"] = !bs.empty();
    ctx->set_materialize_grads(false);   // an unused output's weight gets no gradient, as with F.linear each
    at::AutoDispatchBelowADInplaceOrView below;
    return traced_linears_forward(x, ws, bs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const bool biased = ctx->saved_data["biased"].toBool();
    const size_t n = saved.size() - 1;
    variable_list out(1 + n + (biased ? n : 0));
    Tensor dx;
    for (size_t i = 0; i < n; ++i) {
      if (!grads[i].defined()) continue;
      const bool bias_grad = biased && ctx->needs_input_grad(1 + n + i);
      std::vector<Tensor> g = linear_grads_op(grads[i], x, saved[1 + i], bias_grad, ctx->needs_input_grad(1 + i));
      dx = dx.defined() ? dx.add_(g[0]) : g[0];
      if (ctx->needs_input_grad(1 + i)) out[1 + i] = g[1];
      if (bias_grad) out[1 + n + i] = g[2];
    }
    out[0] = dx;
    return out;
  }
};

// The Linears with their autograd, on any device (tests run it on the CPU).
std::vector<Tensor> traced_linears(const Tensor& x, at::TensorList ws, at::TensorList bs) {
  return LinearsFn::apply(x, ws, bs);   // traced_linears_forward checks the biases' count
}

// ops.layernorm_linear.linears on a GPU: the Linears for a call our GEMMs take as it comes (x and every weight and
// bias linear_takes, one dtype and device, no autocast), with no autograd node where no gradient is to come; {} for
// a call the Python route takes (F.linear each).
std::vector<Tensor> linears(const Tensor& x, at::TensorList ws, at::TensorList bs) {
  if (!x.is_cuda() || ws.empty() || (!bs.empty() && bs.size() != ws.size()) || x.dim() < 1 || x.numel() == 0 ||
      !x.is_contiguous() || at::autocast::is_autocast_enabled(at::kCUDA) || !supported(x.scalar_type()))
    return {};
  bool grad = grad_to_come({&x});
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::optional<Tensor> b = bs.empty() ? std::optional<Tensor>() : bs[i];
    if (!linear_takes(x, ws[i], b)) return {};
    grad = grad || grad_to_come({&ws[i]}) || (b.has_value() && grad_to_come({&*b}));
  }
  c10::DeviceGuard guard(x.device());
  return grad ? LinearsFn::apply(x, ws, bs) : traced_linears_forward(x, ws, bs);
}
