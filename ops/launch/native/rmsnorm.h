// RMSNorm forward and backward: LayerNorm's launches told the norm by act's RMSNorm bits (ops/rmsnorm/config.py),
// its autograd function and its entry. Part of direct.cpp's one translation unit (included inside its anonymous
// namespace, after layernorm.h).
#pragma once

// ---------------------------------------------------------------- RMSNorm

// The kernels' RMSNorm bits (ops/kernels/layernorm.mojo: NORM_RMS, RMS_LLAMA, RMS_GEMMA), handed over at loading
// (set_rms_codes), for the ATen form of a double backward.
int64_t rms_norm_bit = 0, rms_llama_bit = 0, rms_gemma_bit = 0;

void set_rms_codes(int64_t norm, int64_t llama, int64_t gemma) {
  rms_norm_bit = norm;
  rms_llama_bit = llama;
  rms_gemma_bit = gemma;
}

// RMSNorm(x) by ATen's differentiable ops, as the semantics' own modules compute it (ops/rmsnorm/fwd_bwd.py:
// torch_rms_norm).
Tensor aten_rms_norm(const Tensor& x, const Tensor& w, double eps, int64_t act) {
  if (!(act & (rms_llama_bit | rms_gemma_bit))) return at::rms_norm(x, {x.size(-1)}, w, eps);
  const Tensor xf = x.to(at::kFloat);
  const Tensor xhat = xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  if (act & rms_gemma_bit) return (xhat * (w.to(at::kFloat) + 1.0)).to(x.scalar_type());
  return w * xhat.to(x.scalar_type());
}

// The Python route's backward (the torch.library op of ops/rmsnorm/) for a call with no plan here yet: it launches
// and registers the plan for the next call.
std::tuple<Tensor, Tensor> rms_bwd_python(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& stats,
                                          int64_t act) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mojo::rms_norm_bwd", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         const Tensor&, c10::string_view)>();
  const char* semantics = act & rms_llama_bit ? "llama" : act & rms_gemma_bit ? "gemma" : "torch";
  const int64_t h = x.size(-1);
  auto [dx, dw] = op.call(dy.view({-1, h}), x.view({-1, h}), w, stats[0], stats[1], semantics);
  return {dx.view(x.sizes()), dw};
}

struct RMSNormFn : public torch::autograd::Function<RMSNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps, int64_t act,
                        const FwdPlan* plan) {
    Tensor stats = stats_for(x);
    Tensor y = ln_fwd(*plan, x, w, w, eps, stats.data_ptr(), stat_row(stats, 1));   // beta: unused by RMSNorm
    ctx->save_for_backward({x, w, stats});
    ctx->saved_data["act"] = act;
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const int64_t act = ctx->saved_data["act"].toInt();
    if (at::GradMode::is_enabled()) {   // create_graph: as layernorm.h's
      variable_list g = differentiable_grads(
          ctx, aten_rms_norm(saved[0], saved[1], ctx->saved_data["eps"].toDouble(), act), {saved[0], saved[1]},
          grads[0]);
      return {g[0], g[1], Tensor(), Tensor(), Tensor()};
    }
    const Tensor dy = grads[0].contiguous();
    auto plan = bwd_plan(dy, saved[0], saved[1], saved[1], {&saved[2]}, act);
    if (!plan) {
      auto [dx, dw] = rms_bwd_python(dy, saved[0], saved[1], saved[2], act);
      return {dx, dw, Tensor(), Tensor(), Tensor()};
    }
    auto [dx, dw, unused] = ln_bwd_run(*plan, dy, saved[0], saved[1], saved[1], saved[2].data_ptr(),
                                       stat_row(saved[2], 1));
    return {dx, dw, Tensor(), Tensor(), Tensor()};
  }
};

// RMSNorm(x) over the last dim with autograd (act: the semantics' code), or undefined for a call the Python route
// takes (no plan yet, or inputs accepts() would not send to the kernels as they come).
Tensor rms_norm(const Tensor& x_in, const Tensor& w, double eps, int64_t act) {
  const Tensor x = dense(x_in, w, w);
  auto plan = fwd_plan(x, w, w, eps, act);
  if (!plan) return Tensor();
  c10::DeviceGuard guard(x.device());
  if (!grad_to_come({&x, &w})) return ln_fwd(*plan, x, w, w, eps, nullptr, nullptr);
  return RMSNormFn::apply(x, w, eps, act, &*plan);
}

// ---------------------------------------------------------------- RMSNorm + Linear

// Linear(RMSNorm(x)), one autograd node: our RMSNorm launched on its plan (its statistics in one buffer), then the
// Linear by cuBLASLt; xn kept for dW. Backward: LinearBackward's dxn, dW and db, then the RMSNorm backward.
struct RMSNormLinearFn : public torch::autograd::Function<RMSNormLinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& nw, const Tensor& w,
                        const std::optional<Tensor>& bias, double eps, int64_t act, const FwdPlan* plan) {
    Tensor stats = stats_for(x);
    Tensor xn = ln_fwd(*plan, x, nw, nw, eps, stats.data_ptr(), stat_row(stats, 1));
    ctx->save_for_backward({x, xn, nw, w, stats});
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = act;
    return linear_forward(xn, w, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const int64_t act = ctx->saved_data["act"].toInt();
    const bool bias_grad = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(3);
    if (at::GradMode::is_enabled()) {   // create_graph: as layernorm.h's; db = dy's column sums
      const Tensor y = at::linear(aten_rms_norm(s[0], s[2], ctx->saved_data["eps"].toDouble(), act), s[3]);
      variable_list g = differentiable_grads(ctx, y, {s[0], s[2], s[3]}, grads[0]);
      Tensor db = bias_grad ? grads[0].reshape({-1, grads[0].size(-1)}).sum(0) : Tensor();
      return {g[0], g[1], g[2], db, Tensor(), Tensor(), Tensor()};
    }
    const Tensor dy = grads[0].contiguous();
    c10::DeviceGuard guard(dy.device());
    LinearBackward linear(dy, s[1], s[3], ctx->needs_input_grad(2), bias_grad);
    const Tensor dxn = linear.input();
    linear.weights();
    auto plan = bwd_plan(dxn, s[0], s[2], s[2], {&s[4]}, act);
    if (!plan) {
      auto [dx, dnw] = rms_bwd_python(dxn, s[0], s[2], s[4], act);
      return {dx, dnw, linear.dw, linear.db, Tensor(), Tensor(), Tensor()};
    }
    auto [dx, dnw, unused] = ln_bwd_run(*plan, dxn, s[0], s[2], s[2], s[4].data_ptr(), stat_row(s[4], 1));
    return {dx, dnw, linear.dw, linear.db, Tensor(), Tensor(), Tensor()};
  }
};

// Linear(RMSNorm(x)) with autograd (ops/rmsnorm/functional.py: rms_norm_linear; act: the semantics' code), or
// undefined for a call the Python route takes (no RMSNorm plan yet, or inputs linear_accepts would not take).
Tensor rms_norm_linear(const Tensor& x_in, const Tensor& nw, const Tensor& w, const std::optional<Tensor>& bias,
                       double eps, int64_t act) {
  if (!x_in.is_cuda() || !linear_accepts(x_in, nw, nw, w, bias, true)) return Tensor();
  const Tensor x = dense(x_in, nw, nw);
  auto plan = fwd_plan(x, nw, nw, eps, act);
  if (!plan) return Tensor();
  c10::DeviceGuard guard(x.device());
  if (!grad_to_come({&x, &nw, &w}) && !(bias.has_value() && grad_to_come({&*bias})))
    return linear_forward(ln_fwd(*plan, x, nw, nw, eps, nullptr, nullptr), w, bias);
  return RMSNormLinearFn::apply(x, nw, w, bias, eps, act, &*plan);
}
