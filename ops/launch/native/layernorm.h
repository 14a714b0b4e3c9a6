// LayerNorm (+GELU) forward and backward: the launches, the autograd function and the entry.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// ---------------------------------------------------------------- LayerNorm forward and backward

// y like x; the rows' statistics into float32 [rows] buffers at mean and rstd, or nowhere when mean is null.
Tensor ln_fwd(const FwdPlan& plan, const Tensor& x, const Tensor& w, const Tensor& b, double eps, void* mean,
              void* rstd) {
  const int64_t h = x.size(-1);
  int32_t rows = static_cast<int32_t>(x.numel() / h), h32 = static_cast<int32_t>(h);
  float eps32 = static_cast<float>(eps);
  Tensor y = empty(x.sizes(), x.options());
  void* yp = y.data_ptr();
  void* xp = x.data_ptr();
  void* wp = w.data_ptr();
  void* bp = b.data_ptr();
  void* params[] = {&yp, &mean, &rstd, &xp, &wp, &bp, &rows, &h32, &eps32};
  launch(x.device(), plan.kernel, plan.grid, plan.block, plan.cluster, params);
  return y;
}

// The forward's plan for a call the C++ route takes (``takes``), or none (the call goes to Python).
std::optional<FwdPlan> fwd_plan(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  if (!takes(x, w, b)) return std::nullopt;
  const int64_t h = x.size(-1);
  return find(fwd_plans, fwd_key(x.numel() / h, h, x.scalar_type(), vec_ok(h, {&x, &w, &b}), act, x.get_device()));
}

const char* ACTIVATIONS[] = {"none", "gelu_tanh", "gelu"};   // layernorm.ACTIVATIONS, by number

// The Python route's forward and backward (the torch.library ops of ops/layernorm/), for a call this file
// does not take: they validate (named errors), launch, and register the plan for the next call.
Triple ln_fwd_python(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mojo::layernorm_fwd", "")
                       .typed<Triple(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view,
                                     c10::string_view)>();
  return op.call(x, w, b, eps, "fast", ACTIVATIONS[act]);
}

Triple ln_bwd_python(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean,
                     const Tensor& rstd, int64_t act) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mojo::layernorm_bwd", "")
                       .typed<Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, c10::string_view)>();
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  return op.call(dy, x, w, b, mean.view(stat_shape), rstd.view(stat_shape), ACTIVATIONS[act]);
}

// The backward's plan for a call its kernels take as they come (contiguous CUDA x and dy alike, float32 statistics
// of a value per row, contiguous), or none (a benchmark that forces the backward's launch hands over no plan).
std::optional<BwdPlan> bwd_plan(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b,
                                std::initializer_list<const Tensor*> stats, int64_t act) {
  if (!x.is_cuda() || !plain({&dy, &x, &w, &b}) || x.dim() < 1 || x.numel() == 0 || !x.is_contiguous() ||
      !dy.is_contiguous() || dy.sizes() != x.sizes() || dy.scalar_type() != x.scalar_type() ||
      dy.device() != x.device())
    return std::nullopt;
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const int64_t per_tensor = rows * (stats.size() == 1 ? 2 : 1);   // a [2, rows] buffer, or mean and rstd
  for (const Tensor* stat : stats)
    if (stat->scalar_type() != at::kFloat || !stat->is_contiguous() || stat->numel() != per_tensor ||
        stat->device() != x.device())
      return std::nullopt;
  return find(bwd_plans, fwd_key(rows, h, x.scalar_type(), vec_ok(h, {&dy, &x, &w, &b}), act, x.get_device()));
}

// dx, dweight, dbias by the plan's two launches (the rows' groups, then the columns' sums of their partials); with
// `sums_on` (sums_streams), the sums run on its first stream, after the rows, and the others wait for them. An
// RMSNorm's kernels (act's NORM_RMS) write neither dbias nor part's second plane: its callers drop dbias.
Triple ln_bwd_run(const BwdPlan& plan, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b,
                  void* mean_p, void* rstd_p, const std::vector<c10::Stream>& sums_on = {}) {
  const int64_t h = x.size(-1);
  const int64_t rows = x.numel() / h;
  Tensor dx = empty(x.sizes(), x.options());
  Tensor part = empty({2, plan.part_rows, h}, x.options().dtype(at::kFloat));
  void* dxp = dx.data_ptr();
  void* part_g = part.data_ptr();
  void* part_b = static_cast<float*>(part_g) + plan.part_rows * h;
  void* dyp = dy.data_ptr();
  void* xp = x.data_ptr();
  void* wp = w.data_ptr();
  void* bp = b.data_ptr();
  int32_t rows32 = static_cast<int32_t>(rows), h32 = static_cast<int32_t>(h);
  int32_t parts32 = static_cast<int32_t>(plan.parts), part_rows32 = static_cast<int32_t>(plan.part_rows);
  void* row_params[] = {&dxp, &part_g, &part_b, &dyp, &xp, &wp, &bp, &mean_p, &rstd_p, &rows32, &h32, &parts32};
  c10::DeviceGuard guard(x.device());
  launch(x.device(), plan.rows_kernel, plan.grid, plan.block, 1, row_params);
  std::optional<c10::StreamGuard> on_sums;
  if (!sums_on.empty()) {
    const auto* impl = c10::impl::getDeviceGuardImpl(x.device().type());
    join(torch_stream(x.device()), sums_on[0]);   // the sums wait for the rows
    impl->recordDataPtrOnStream(part.storage().data_ptr(), sums_on[0]);   // read there after the rows' stream moves on
    on_sums.emplace(sums_on[0]);   // dw and db are allocated on, and the sums launched on, that stream
  }
  Tensor dw = empty(w.sizes(), w.options()), db = empty(b.sizes(), b.options());
  void* dwp = dw.data_ptr();
  void* dbp = db.data_ptr();
  void* reduce_params[] = {&dwp, &dbp, &part_g, &part_b, &part_rows32, &h32};
  launch(x.device(), plan.reduce_kernel, plan.reduce_grid, plan.reduce_block, 1, reduce_params);
  for (size_t i = 1; i < sums_on.size(); ++i) join(sums_on[0], sums_on[i]);
  return {dx, dw, db};
}

// dx, dweight, dbias from dy (like x) and the forward's statistics (float32, a value per row each).
Triple ln_bwd(const Tensor& dy_in, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean,
              const Tensor& rstd, int64_t act) {
  const Tensor dy = dy_in.contiguous();
  auto plan = bwd_plan(dy, x, w, b, {&mean, &rstd}, act);
  if (!plan) return ln_bwd_python(dy, x, w, b, mean, rstd, act);
  return ln_bwd_run(*plan, dy, x, w, b, mean.data_ptr(), rstd.data_ptr());
}

// The same from the autograd forward's one float32 [2, rows] statistics buffer (mean, then rstd).
Triple ln_bwd(const Tensor& dy_in, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& stats,
              int64_t act, const std::vector<c10::Stream>& sums_on = {}) {
  const Tensor dy = dy_in.contiguous();
  auto plan = bwd_plan(dy, x, w, b, {&stats}, act);
  if (!plan) return ln_bwd_python(dy, x, w, b, stats[0], stats[1], act);
  return ln_bwd_run(*plan, dy, x, w, b, stats.data_ptr(), stat_row(stats, 1), sums_on);
}

// ops/layernorm/'s layernorm_bwd in eager: (dx, dweight, dbias), or none for a call Python takes (no plan yet,
// another layout, dtype or device; Python validates those and names what is wrong).
std::vector<Tensor> layernorm_bwd_with_plan(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b,
                                            const Tensor& mean, const Tensor& rstd, int64_t act) {
  if (act < 0 || act > 2 || !takes(x, w, b)) return {};
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  if (mean.sizes() != stat_shape || rstd.sizes() != stat_shape) return {};
  auto plan = bwd_plan(dy, x, w, b, {&mean, &rstd}, act);
  if (!plan) return {};
  auto [dx, dw, db] = ln_bwd_run(*plan, dy, x, w, b, mean.data_ptr(), rstd.data_ptr());
  return {dx, dw, db};
}

// One float32 [2, rows] buffer for the rows' mean and rstd (one allocation; its rows by address, no views).
Tensor stats_for(const Tensor& x) {
  return empty({2, x.numel() / x.size(-1)}, x.options().dtype(at::kFloat));
}

bool grad_to_come(std::initializer_list<const Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : tensors)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// act(LayerNorm(x)) by ATen's differentiable ops (act: ACTIVATIONS of ops/layernorm/).
Tensor aten_layernorm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  Tensor z = at::layer_norm(x, {x.size(-1)}, w, b, eps);
  return act == 0 ? z : at::gelu(z, act == 1 ? "tanh" : "none");
}

// A backward under create_graph (grad mode on in it: a double backward, a gradient penalty): the gradients of y,
// recomputed from the saved inputs by ATen's differentiable ops, for the inputs that want one (needs_input_grad,
// from the first), so that they carry their own graph as torch's LayerNorm's do (our kernels' could not).
variable_list differentiable_grads(AutogradContext* ctx, const Tensor& y, const variable_list& inputs,
                                   const Tensor& dy) {
  variable_list wrt, out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    if (ctx->needs_input_grad(i)) wrt.push_back(inputs[i]);
  if (wrt.empty()) return out;
  auto g = torch::autograd::grad({y}, wrt, {dy}, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t i = 0, j = 0; i < inputs.size(); ++i)
    if (ctx->needs_input_grad(i)) out[i] = g[j++];
  return out;
}

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                        int64_t act, const FwdPlan* plan, const Beside* beside) {
    Tensor stats = stats_for(x);
    Tensor y = ln_fwd(*plan, x, w, b, eps, stats.data_ptr(), stat_row(stats, 1));
    ctx->save_for_backward({x, w, b, stats});
    ctx->saved_data["act"] = act;
    ctx->saved_data["eps"] = eps;
    save_beside(ctx, *beside);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    accumulated_beside(ctx);
    auto saved = ctx->get_saved_variables();
    const int64_t act = ctx->saved_data["act"].toInt();
    if (at::GradMode::is_enabled()) {
      variable_list g = differentiable_grads(
          ctx, aten_layernorm(saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(), act),
          {saved[0], saved[1], saved[2]}, grads[0]);
      return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor(), Tensor()};
    }
    auto [dx, dw, db] = ln_bwd(grads[0], saved[0], saved[1], saved[2], saved[3], act,
                               sums_streams(ctx, saved[1], saved[2]));
    return {dx, dw, db, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// act(LayerNorm(x)) with autograd, or undefined for a call the Python route takes.
Tensor layernorm(const Tensor& x_in, const Tensor& w, const Tensor& b, double eps, int64_t act) {
  const Tensor x = dense(x_in, w, b);
  auto plan = fwd_plan(x, w, b, eps, act);
  if (!plan) return Tensor();
  c10::DeviceGuard guard(x.device());
  if (!grad_to_come({&x, &w, &b})) return ln_fwd(*plan, x, w, b, eps, nullptr, nullptr);
  const Beside beside = accumulate_beside(x.device(), x.numel() / x.size(-1), {&w, &b});
  return LayerNormFn::apply(x, w, b, eps, act, &*plan, &beside);
}
