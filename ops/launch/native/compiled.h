// The LayerNorm ops torch.compile's graphs call (no autograd).
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// ---------------------------------------------------------------- the ops torch.compile's graphs call

// The forward as an op without autograd (torch.compile traces ops/layernorm/'s autograd.Function around
// it): y, mean, rstd; a call without a plan here goes to the Python route's op.
std::optional<Triple> ln_fwd_stats(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  auto plan = fwd_plan(x, w, b, eps, act);
  if (!plan) return std::nullopt;
  c10::DeviceGuard guard(x.device());
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  Tensor mean = empty(stat_shape, x.options().dtype(at::kFloat));
  Tensor rstd = empty(stat_shape, x.options().dtype(at::kFloat));
  Tensor y = ln_fwd(*plan, x, w, b, eps, mean.data_ptr(), rstd.data_ptr());
  return Triple{y, mean, rstd};
}

Triple layernorm_fwd(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  auto out = ln_fwd_stats(x, w, b, eps, act);
  return out ? *out : ln_fwd_python(x, w, b, eps, act);
}

// ops/layernorm/'s layernorm_fwd (y, mean, rstd) in eager: the three, or none for a call Python takes.
std::vector<Tensor> layernorm_with_stats(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  auto out = ln_fwd_stats(dense(x, w, b), w, b, eps, act);
  if (!out) return {};
  return {std::get<0>(*out), std::get<1>(*out), std::get<2>(*out)};
}

// The forward without statistics (inference under torch.compile): y.
Tensor layernorm_infer(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  auto plan = fwd_plan(x, w, b, eps, act);
  if (!plan) return std::get<0>(ln_fwd_python(x, w, b, eps, act));
  c10::DeviceGuard guard(x.device());
  return ln_fwd(*plan, x, w, b, eps, nullptr, nullptr);
}

const char* ALGOS[] = {"auto", "fused", "sm90", "unfused"};   // layernorm_linear.ALGOS, by number

// Inference under torch.compile where ``algo`` resolves to "fused" or "sm90": y by the plan Python handed over,
// or else by the Python route's op (mojo::layernorm_linear_fwd: it validates, launches, and hands the plan over).
Tensor layernorm_linear_infer(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                              const std::optional<Tensor>& bias, double eps, int64_t algo) {
  if (auto plan = fused_plan(x, lnw, lnb, w, bias, eps, algo)) {
    c10::DeviceGuard guard(x.device());
    return std::get<0>(fused_forward(*plan, x, lnw, lnb, w, bias, eps));
  }
  TORCH_CHECK(algo >= 0 && algo < 4, "mojo_direct: layernorm_linear_infer: algo must be 0-3, got ", algo);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mojo::layernorm_linear_fwd", "")
                       .typed<Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     double, c10::string_view)>();
  const Tensor b = bias.has_value() && bias->defined() ? *bias : at::zeros({w.size(0)}, w.options());
  return std::get<0>(op.call(x, lnw, lnb, w, b, eps, ALGOS[algo]));
}

Triple layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean,
                     const Tensor& rstd, int64_t act) {
  if (!takes(x, w, b)) return ln_bwd_python(dy, x, w, b, mean, rstd, act);
  return ln_bwd(dy, x, w, b, mean, rstd, act);
}
