// LayerNorm+Linear: the unfused route's autograd function and entry, and the fused and Hopper forwards.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// ---------------------------------------------------------------- LayerNorm + Linear (unfused)

struct LayerNormLinearFn : public torch::autograd::Function<LayerNormLinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                        const std::optional<Tensor>& bias, double eps, const FwdPlan* plan, const Beside* beside) {
    Tensor stats = stats_for(x);
    Tensor xn = ln_fwd(*plan, x, lnw, lnb, eps, stats.data_ptr(), stat_row(stats, 1));
    ctx->save_for_backward({x, xn, lnw, lnb, w, stats});
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["eps"] = eps;
    save_beside(ctx, *beside);
    return linear_forward(xn, w, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    accumulated_beside(ctx);
    auto s = ctx->get_saved_variables();
    const bool bias_grad = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(4);
    if (at::GradMode::is_enabled()) {   // as in LayerNormFn; db = dy's column sums
      const Tensor y = at::linear(aten_layernorm(s[0], s[2], s[3], ctx->saved_data["eps"].toDouble(), 0), s[4]);
      variable_list g = differentiable_grads(ctx, y, {s[0], s[2], s[3], s[4]}, grads[0]);
      Tensor db = bias_grad ? grads[0].reshape({-1, grads[0].size(-1)}).sum(0) : Tensor();
      return {g[0], g[1], g[2], g[3], db, Tensor(), Tensor(), Tensor()};
    }
    const Tensor dy = grads[0].contiguous();
    c10::DeviceGuard guard(dy.device());
    LinearBackward linear(dy, s[1], s[4], ctx->needs_input_grad(3), bias_grad);
    std::optional<c10::Stream> captured, side;   // under capture: the captured stream and the side one
    if (linear.wgrad != nullptr && captured_weight_grads_beside && capturing(dy.device())) {
      captured = torch_stream(dy.device());
      side = fork_from(*captured);
      c10::StreamGuard on_side(*side);
      linear.weights();
    }
    Tensor dxn = linear.input();
    if (!side) linear.weights();
    auto [dx, dlnw, dlnb] = ln_bwd(dxn, s[0], s[2], s[3], s[5], 0, sums_streams(ctx, s[2], s[3]));
    if (side) join(*side, *captured);
    return {dx, dlnw, dlnb, linear.dw, linear.db, Tensor(), Tensor(), Tensor()};
  }
};

// The LayerNorm+Linear tables' key, one layout for lookups and registrations: the shape, dtype, device and algo,
// then `variant` (in linear_unfused: whether a gradient is to come, plus 2 under stream capture; in fused_plans: the
// alignment mask).
Key lnl_key(int64_t rows, int64_t k, int64_t n, at::ScalarType dtype, int64_t device, int64_t algo, int64_t variant) {
  return {rows, k, n, static_cast<int64_t>(dtype), device, algo, variant, 1};
}

Key lnl_key(const Tensor& x, const Tensor& w, int64_t algo, int64_t variant) {
  const int64_t k = x.size(-1);
  return lnl_key(x.numel() / k, k, w.size(0), x.scalar_type(), x.get_device(), algo, variant);
}

// ---------------------------------------------------------------- LayerNorm + Linear (fused and Hopper forwards)

// The alignment facts the kernels' host code branches on (ops/layernorm_linear/config.py: align_mask).
int64_t align_mask(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w) {
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % VECTOR_BYTES == 0; };
  const int64_t width = VECTOR_BYTES / static_cast<int64_t>(x.element_size());
  return int64_t(x.size(-1) % width == 0) | int64_t(aligned(x)) << 1 | int64_t(aligned(w)) << 2 |
         int64_t(aligned(lnw)) << 3 | int64_t(aligned(lnb)) << 4;
}

Key fused_key(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w, int64_t algo) {
  return lnl_key(x, w, algo, align_mask(x, lnw, lnb, w));
}

// The first of a plan's launches that goes out as a dependent launch (PDL): 0, all of them, by default;
// set_pdl_from, a benchmark's A/B (1: from the second; a large index: none; docs/direct_launch.md).
std::atomic<int64_t> pdl_first{0};

void set_pdl_from(int64_t first) { pdl_first = first; }

int64_t pdl_from() { return pdl_first.load(); }

// Launch `index` of a plan's steps; dependent: the kernel waits (griddepcontrol.wait) before it reads what the
// stream's previous kernel writes, so it may go out as that kernel's programmatic dependent.
void run(const at::Device& device, const Step& step, void** params, int index = 0, bool dependent = false) {
  launch(device, step.kernel, step.grid, step.block, 1, params, step.smem, dependent && index >= pdl_from());
}

// A 2-D row-major tensor map of a 16-bit [rows, cols] array at `address`, boxes of box_rows x box_cols.
TensorMap tensor_map(void* address, int64_t rows, int64_t cols, int64_t box_rows, int64_t box_cols, int64_t dtype,
                     int swizzle) {
  TORCH_CHECK(driver().encode_tiled != nullptr, "mojo_direct: the driver has no cuTensorMapEncodeTiled");
  TensorMap map{};
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(cols) * 2};
  const unsigned box[2] = {static_cast<unsigned>(box_cols), static_cast<unsigned>(box_rows)};
  const unsigned ones[2] = {1, 1};
  check(driver().encode_tiled(&map, static_cast<int>(dtype), 2, address, dims, strides, box, ones, 0, swizzle, 0, 0));
  return map;
}

constexpr int SWIZZLE_NONE = 0, SWIZZLE_128B = 3;

// A scratch part's length rounded up to 64 elements (256 bytes of float32 or more), so the next part is aligned.
int64_t padded(int64_t len) { return (len + 63) / 64 * 64; }

// y [..., n], mean and rstd [rows] (float32) by the plan's kernels, on contiguous
// x [..., k], lnw, lnb [k], w [n, k] and bias [n] (the plan's zeros when undefined).
Triple fused_forward(const FusedPlan& plan, const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                     const std::optional<Tensor>& bias_in, double eps) {
  const int64_t k = x.size(-1), n = w.size(0), rows = x.numel() / k;
  const Tensor& bias = bias_in.has_value() && bias_in->defined() ? *bias_in : plan.zero_bias;
  auto shape = x.sizes().vec();
  shape.back() = n;
  Tensor y = empty(shape, x.options());
  // mean and rstd apart (not rows of one buffer): the torch.library op returns them, and its outputs may not alias
  Tensor mean = empty({rows}, x.options().dtype(at::kFloat));
  Tensor rstd = empty({rows}, x.options().dtype(at::kFloat));
  void *yp = y.data_ptr(), *mp = mean.data_ptr(), *rp = rstd.data_ptr(), *xp = x.data_ptr();
  void *gp = lnw.data_ptr(), *bp = lnb.data_ptr(), *wp = w.data_ptr(), *biasp = bias.data_ptr();
  int32_t rows32 = static_cast<int32_t>(rows), k32 = static_cast<int32_t>(k), n32 = static_cast<int32_t>(n);
  float eps32 = static_cast<float>(eps);
  const auto& z = plan.sizes;
  const at::Device device = x.device();
  if (plan.kind == KIND_SM90) {
    // the fold's ext rows [n, z[8]]
    Tensor ext = at::empty({n * z[8]}, x.options());
    void* extp = ext.data_ptr();
    void* prep[] = {&extp, &wp, &gp, &bp, &biasp, &k32, &n32};
    run(device, plan.steps[0], prep, 0, /*dependent=*/true);   // its launch overlaps the previous kernel's tail
    const int64_t dtype = z[9];
    TensorMap xm = tensor_map(xp, rows, k, z[0], z[1], dtype, SWIZZLE_128B);
    TensorMap wm = tensor_map(wp, n, k, z[2], z[3], dtype, SWIZZLE_128B);
    TensorMap ym = tensor_map(yp, rows, n, z[4], z[5], dtype, SWIZZLE_128B);
    TensorMap em = tensor_map(extp, n / 8, 8 * z[8], z[6], z[7], dtype, SWIZZLE_NONE);
    void* main[] = {&xm, &wm, &ym, &em, &mp, &rp, &gp, &rows32, &k32, &n32, &eps32};
    run(device, plan.steps[1], main, 1, /*dependent=*/true);   // starts before the prep ends; waits for ext
    return {y, mean, rstd};
  }
  // fold [2, n], then the per-split partial products and row sums: one float32 scratch allocation, each part
  // starting on a 256-byte boundary (the kernels store vectors)
  const int64_t splits = z[0], fold_len = padded(2 * n), acc_len = padded(splits * z[2]);
  Tensor scratch = at::empty({fold_len + acc_len + splits * z[3]}, x.options().dtype(at::kFloat));
  float* fold = scratch.data_ptr<float>();
  void *foldp = fold, *accp = fold + fold_len, *partp = fold + fold_len + acc_len;
  int32_t chunk32 = static_cast<int32_t>(z[1]), splits32 = static_cast<int32_t>(splits);
  int32_t vec32 = static_cast<int32_t>(z[4]);
  void* fold_params[] = {&foldp, &wp, &gp, &bp, &biasp, &k32, &n32};
  run(device, plan.steps[0], fold_params);
  if (plan.kind == KIND_FUSED16) {
    void* cp = plan.counters.data_ptr();
    void* params[] = {&yp, &mp, &rp, &foldp, &accp, &partp, &cp, &xp, &gp, &wp, &rows32, &k32, &n32, &chunk32, &eps32};
    run(device, plan.steps[1], params);
  } else {
    void* params[] = {&accp, &partp, &mp, &xp, &gp, &wp, &rows32, &k32, &n32, &chunk32, &vec32};
    run(device, plan.steps[1], params);
    void* finish[] = {&yp, &mp, &rp, &foldp, &accp, &partp, &rows32, &k32, &n32, &splits32, &eps32};
    run(device, plan.steps[2], finish);
  }
  return {y, mean, rstd};
}

std::optional<FusedPlan> fused_plan(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                                    const std::optional<Tensor>& bias, double eps, int64_t algo) {
  if (!x.is_cuda() || !linear_accepts(x, lnw, lnb, w, bias)) return std::nullopt;
  return find(fused_plans, fused_key(x, lnw, lnb, w, algo));
}

// ops/layernorm_linear/'s layernorm_linear_fwd (y, mean, rstd) where ``algo`` resolves to "fused" or "sm90"
// and Python handed over the plan; none for a call Python takes.
std::vector<Tensor> layernorm_linear_with_stats(const Tensor& x_in, const Tensor& lnw, const Tensor& lnb,
                                                const Tensor& w, const std::optional<Tensor>& bias, double eps,
                                                int64_t algo) {
  const Tensor x = dense(x_in, lnw, lnb);
  auto plan = fused_plan(x, lnw, lnb, w, bias, eps, algo);
  if (!plan) return {};
  c10::DeviceGuard guard(x.device());
  auto [y, mean, rstd] = fused_forward(*plan, x, lnw, lnb, w, bias, eps);
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  return {y, mean.view(stat_shape), rstd.view(stat_shape)};
}

// Linear(LayerNorm(x)) with autograd where ``algo`` (an index into layernorm_linear.ALGOS) resolves to
// "unfused" (set_linear_algo), or undefined for a call the Python route takes.
Tensor layernorm_linear(const Tensor& x_in, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                        const std::optional<Tensor>& bias, double eps, int64_t algo) {
  if (!x_in.is_cuda() || !linear_accepts(x_in, lnw, lnb, w, bias, true)) return Tensor();
  const bool grad = grad_to_come({&x_in, &lnw, &lnb, &w}) || (bias.has_value() && grad_to_come({&*bias}));
  const bool captured = capturing(x_in.device());
  const int64_t variant = int64_t(grad) | int64_t(captured) << 1;   // set_linear_algo's
  auto unfused = find(linear_unfused, lnl_key(x_in, w, algo, variant));
  // No choice made for this variant yet (the Python route makes it), or the fused and Hopper forwards with a
  // gradient to come (Python's autograd).
  if (!unfused || (!*unfused && grad)) return Tensor();
  const Tensor x = dense(x_in, lnw, lnb);
  if (!*unfused) {
    auto fused = find(fused_plans, fused_key(x, lnw, lnb, w, algo));
    if (!fused) return Tensor();
    c10::DeviceGuard guard(x.device());
    return std::get<0>(fused_forward(*fused, x, lnw, lnb, w, bias, eps));
  }
  auto plan = fwd_plan(x, lnw, lnb, eps, 0);
  if (!plan) return Tensor();
  c10::DeviceGuard guard(x.device());
  if (!grad) return linear_forward(ln_fwd(*plan, x, lnw, lnb, eps, nullptr, nullptr), w, bias);
  const Tensor no_bias;
  const Beside beside = accumulate_beside(x.device(), x.numel() / x.size(-1),
                                          {&lnw, &lnb, &w, bias.has_value() ? &*bias : &no_bias}, captured);
  return LayerNormLinearFn::apply(x, lnw, lnb, w, bias, eps, &*plan, &beside);
}
