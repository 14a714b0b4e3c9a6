// A pre-norm block's add and norm in one pass (ops/kernels/layernorm.mojo: add_norm_fwd_regs), for LayerNorm and
// RMSNorm alike (act's code), with C++ autograd: the entry behind add_layer_norm and add_rms_norm on a GPU.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, after rmsnorm.h).
#pragma once

// ---------------------------------------------------------------- add and norm

// By (rows, h, dtype, act, add_bias given, device): the kernel, grid and block Python chose (ops/layernorm/launch.py:
// add_norm_plan, handed over by registration.h's set_add_norm_plan), for shapes whose norm launch is the register
// kernel.
std::unordered_map<Key, FwdPlan, KeyHash> add_norm_plans;

Key add_norm_key(int64_t rows, int64_t h, at::ScalarType dtype, int64_t act, bool bias, int64_t device) {
  return {rows, h, static_cast<int64_t>(dtype), act, bias, device, 1, 0};
}

// The plan for a call the kernel reads as it comes (the mirror of ops/layernorm/autograd.py's _plan): plain
// contiguous CUDA tensors of one supported dtype on one device, x and residual of one shape, the rest [h], 16-byte
// vectors, no autocast; or none (Python's route, with its named errors, takes the call).
std::optional<FwdPlan> add_norm_plan(const Tensor& x, const Tensor& r, const std::optional<Tensor>& ab,
                                     const Tensor& w, const Tensor& b, int64_t act) {
  const bool bias = ab.has_value() && ab->defined();
  const Tensor& c = bias ? *ab : w;
  if (!plain({&x, &r, &w, &b, &c}) || !x.is_cuda() || x.dim() < 1 || x.numel() == 0 ||
      at::autocast::is_autocast_enabled(at::kCUDA) || !supported(x.scalar_type()))
    return std::nullopt;
  const int64_t h = x.size(-1);
  for (const Tensor* t : {&r, &w, &b, &c})
    if (t->scalar_type() != x.scalar_type() || t->device() != x.device() || !t->is_contiguous()) return std::nullopt;
  for (const Tensor* t : {&w, &b, &c})
    if (t->dim() != 1 || t->size(0) != h) return std::nullopt;
  if (r.sizes() != x.sizes() || !x.is_contiguous() || h > INT32_LIMIT || x.numel() / h > INT32_LIMIT ||
      !vec_ok(h, {&x, &r, &w, &b, &c}))
    return std::nullopt;
  return find(add_norm_plans, add_norm_key(x.numel() / h, h, x.scalar_type(), act, bias, x.get_device()));
}

// (y, s) and the rows' statistics (a float32 [2, rows] buffer) by the plan's one launch.
std::tuple<Tensor, Tensor, Tensor> add_norm_run(const FwdPlan& plan, const Tensor& x, const Tensor& r,
                                                const Tensor& ab, const Tensor& w, const Tensor& b, double eps) {
  const int64_t h = x.size(-1);
  Tensor y = empty(x.sizes(), x.options()), s = empty(x.sizes(), x.options()), stats = stats_for(x);
  int32_t rows = static_cast<int32_t>(x.numel() / h), h32 = static_cast<int32_t>(h);
  float eps32 = static_cast<float>(eps);
  void *yp = y.data_ptr(), *sp = s.data_ptr(), *mp = stats.data_ptr(), *rp_stat = stat_row(stats, 1);
  void *xp = x.data_ptr(), *rp = r.data_ptr(), *abp = ab.defined() ? ab.data_ptr() : x.data_ptr();
  void *wp = w.data_ptr(), *bp = b.data_ptr();
  void* params[] = {&yp, &sp, &mp, &rp_stat, &xp, &rp, &abp, &wp, &bp, &rows, &h32, &eps32};
  launch(x.device(), plan.kernel, plan.grid, plan.block, 1, params);
  return {y, s, stats};
}

bool is_rms(int64_t act) { return (act & rms_norm_bit) != 0; }

// Without an add_bias, ab is w again (apply takes no undefined tensor: it asks every input for its device) and
// `bias` says so.
struct AddNormFn : public torch::autograd::Function<AddNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& ab,
                               const Tensor& w, const Tensor& b, double eps, int64_t act, bool bias,
                               const FwdPlan* plan) {
    auto [y, s, stats] = add_norm_run(*plan, x, r, bias ? ab : Tensor(), w, b, eps);
    ctx->save_for_backward({x, r, bias ? ab : Tensor(), w, b, s, stats});
    ctx->saved_data["act"] = act;
    ctx->saved_data["eps"] = eps;
    return {y, s};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto v = ctx->get_saved_variables();
    const int64_t act = ctx->saved_data["act"].toInt();
    const Tensor& s = v[5];
    const Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(s);
    if (at::GradMode::is_enabled()) return differentiable(ctx, v, dy, grads[1], act);
    Tensor dx, dw, db;
    auto plan = bwd_plan(dy, s, v[3], v[4], {&v[6]}, act);
    if (plan) {
      std::tie(dx, dw, db) = ln_bwd_run(*plan, dy, s, v[3], v[4], v[6].data_ptr(), stat_row(v[6], 1));
    } else if (is_rms(act)) {
      std::tie(dx, dw) = rms_bwd_python(dy, s, v[3], v[6], act);
    } else {
      std::tie(dx, dw, db) = ln_bwd_python(dy, s, v[3], v[4], v[6][0], v[6][1], act);
    }
    if (grads[1].defined()) dx.add_(grads[1]);
    Tensor dab = v[2].defined() && ctx->needs_input_grad(2) ? dx.reshape({-1, dx.size(-1)}).sum(0) : Tensor();
    return {dx, dx, dab, dw, is_rms(act) ? Tensor() : db, Tensor(), Tensor(), Tensor(), Tensor()};
  }

  // Under create_graph: the add and the norm by ATen's ops, differentiated, so the gradients carry their own graph.
  static variable_list differentiable(AutogradContext* ctx, const variable_list& v, const Tensor& dy,
                                      const Tensor& ds, int64_t act) {
    const Tensor s = (v[2].defined() ? v[0] + v[2] : v[0]) + v[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const Tensor y = is_rms(act) ? aten_rms_norm(s, v[3], eps, act) : at::layer_norm(s, {s.size(-1)}, v[3], v[4], eps);
    variable_list wrt, out(9);
    std::vector<size_t> which;
    for (size_t i = 0; i < 5; ++i)
      if (ctx->needs_input_grad(i) && v[i].defined() && !(i == 4 && is_rms(act))) {
        wrt.push_back(v[i]);
        which.push_back(i);
      }
    if (wrt.empty()) return out;
    variable_list outs{y}, gs{dy};
    if (ds.defined()) {
      outs.push_back(s);
      gs.push_back(ds);
    }
    auto g = torch::autograd::grad(outs, wrt, gs, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
    for (size_t j = 0; j < which.size(); ++j) out[which[j]] = g[j];
    return out;
  }
};

// add_layer_norm / add_rms_norm on a GPU: {y, s} with autograd, or {} for a call the Python route takes.
std::vector<Tensor> add_norm(const Tensor& x, const Tensor& r, const std::optional<Tensor>& ab, const Tensor& w,
                             const Tensor& b, double eps, int64_t act) {
  auto plan = add_norm_plan(x, r, ab, w, b, act);
  if (!plan) return {};
  c10::DeviceGuard guard(x.device());
  const bool bias = ab.has_value() && ab->defined();
  if (!grad_to_come({&x, &r, &w, &b}) && !(bias && grad_to_come({&*ab}))) {   // no autograd node to make
    auto [y, s, stats] = add_norm_run(*plan, x, r, bias ? *ab : Tensor(), w, b, eps);
    return {y, s};
  }
  return AddNormFn::apply(x, r, bias ? *ab : w, w, b, eps, act, bias, &*plan);
}
