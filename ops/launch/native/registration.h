// Plan registration from Python, the tables' counts, and the knobs handed over at loading.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// ---------------------------------------------------------------- plan registration (from Python)

std::array<unsigned, 3> dims(at::IntArrayRef v) {
  TORCH_CHECK(v.size() == 3, "mojo_direct: a grid has 3 dims");
  return {static_cast<unsigned>(v[0]), static_cast<unsigned>(v[1]), static_cast<unsigned>(v[2])};
}

CUfunction function(int64_t address) { return reinterpret_cast<CUfunction>(static_cast<uintptr_t>(address)); }

void set_fwd_plan(int64_t rows, int64_t h, at::ScalarType dtype, bool vec, int64_t act, int64_t device,
                  int64_t kernel, at::IntArrayRef grid, int64_t block, int64_t cluster) {
  std::lock_guard<std::mutex> guard(plans_lock);
  fwd_plans[fwd_key(rows, h, dtype, vec, act, device)] =
      FwdPlan{function(kernel), dims(grid), static_cast<unsigned>(block), static_cast<unsigned>(cluster)};
}

void set_bwd_plan(int64_t rows, int64_t h, at::ScalarType dtype, bool vec, int64_t act, int64_t device,
                  int64_t kernel, at::IntArrayRef grid, int64_t block, int64_t parts, int64_t part_rows,
                  int64_t reduce_kernel, at::IntArrayRef reduce_grid, int64_t reduce_block) {
  std::lock_guard<std::mutex> guard(plans_lock);
  bwd_plans[fwd_key(rows, h, dtype, vec, act, device)] =
      BwdPlan{function(kernel),        dims(grid),        static_cast<unsigned>(block), parts, part_rows,
              function(reduce_kernel), dims(reduce_grid), static_cast<unsigned>(reduce_block)};
}

void set_add_norm_plan(int64_t rows, int64_t h, at::ScalarType dtype, int64_t act, bool bias, int64_t device,
                       int64_t kernel, at::IntArrayRef grid, int64_t block) {
  std::lock_guard<std::mutex> guard(plans_lock);
  add_norm_plans[add_norm_key(rows, h, dtype, act, bias, device)] =
      FwdPlan{function(kernel), dims(grid), static_cast<unsigned>(block), 1};
}

void set_linear_algo(int64_t rows, int64_t k, int64_t n, at::ScalarType dtype, int64_t device, int64_t algo,
                     bool grad, bool captured, bool unfused) {
  std::lock_guard<std::mutex> guard(plans_lock);
  linear_unfused[lnl_key(rows, k, n, dtype, device, algo, int64_t(grad) | int64_t(captured) << 1)] = unfused;
}

void set_fused_plan(int64_t rows, int64_t k, int64_t n, at::ScalarType dtype, int64_t device, int64_t algo,
                    int64_t mask, int64_t kind, at::IntArrayRef kernels, at::IntArrayRef grids,
                    at::IntArrayRef blocks, at::IntArrayRef smem, at::IntArrayRef sizes,
                    const std::optional<Tensor>& counters, const Tensor& zero_bias) {
  TORCH_CHECK(grids.size() == 3 * kernels.size() && blocks.size() == kernels.size() &&
                  smem.size() == kernels.size(), "mojo_direct: set_fused_plan: inconsistent lengths");
  FusedPlan plan{kind, {}, sizes.vec(), counters.value_or(Tensor()), zero_bias};
  for (size_t i = 0; i < kernels.size(); ++i)
    plan.steps.push_back(Step{function(kernels[i]), dims(grids.slice(3 * i, 3)), static_cast<unsigned>(blocks[i]),
                              static_cast<unsigned>(smem[i])});
  std::lock_guard<std::mutex> guard(plans_lock);
  fused_plans[lnl_key(rows, k, n, dtype, device, algo, mask)] = std::move(plan);
}

void set_transpose_kernel(at::ScalarType dtype, int64_t device, int64_t kernel, int64_t tile, int64_t threads) {
  std::lock_guard<std::mutex> guard(plans_lock);
  transpose_plans[Key{static_cast<int64_t>(dtype), device, 0, 0, 0, 0, 0, 0}] = {function(kernel), tile, threads};
}

void clear_plans() {
  std::lock_guard<std::mutex> guard(plans_lock);
  transpose_plans.clear();
  fused_plans.clear();
  add_norm_plans.clear();
  fwd_plans.clear();
  bwd_plans.clear();
  linear_unfused.clear();
}

std::vector<int64_t> plan_counts() {
  std::lock_guard<std::mutex> guard(plans_lock);
  return {static_cast<int64_t>(fwd_plans.size()), static_cast<int64_t>(bwd_plans.size()),
          static_cast<int64_t>(linear_unfused.size()), static_cast<int64_t>(fused_plans.size())};
}

void set_poison(bool on) { poison = on; }

// The classifiers' mirrors as ops (tests/test_classify.py compares them with Python's on the bad-input table).
bool layernorm_accepts(const Tensor& x, const Tensor& w, const Tensor& b) { return accepts(x, w, b); }

bool layernorm_linear_accepts(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                              const std::optional<Tensor>& bias) {
  return linear_accepts(x, lnw, lnb, w, bias);
}

// How many shapes run on cuBLASLt (tests).
int64_t gemm_plan_count() {
  std::lock_guard<std::mutex> guard(gemm_lock);
  int64_t count = 0;
  for (const auto& entry : gemm_plans) count += entry.second != nullptr;
  return count;
}
