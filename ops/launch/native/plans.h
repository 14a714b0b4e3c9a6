// The plan tables Python fills (ops/launch/plans.py), their keys, and which calls the entries take.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

// ---------------------------------------------------------------- plan tables (filled from Python)

using Key = std::array<int64_t, 8>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct FwdPlan {
  CUfunction kernel;
  std::array<unsigned, 3> grid;
  unsigned block, cluster;
};

struct BwdPlan {
  CUfunction rows_kernel;
  std::array<unsigned, 3> grid;
  unsigned block;
  int64_t parts, part_rows;  // row groups the first kernel takes; partial rows it writes and the second sums
  CUfunction reduce_kernel;
  std::array<unsigned, 3> reduce_grid;
  unsigned reduce_block;
};

// A fused or Hopper LayerNorm+Linear forward (ops/layernorm_linear/config.py: FusedPlan): its launches in order,
// kind-specific sizes, and the tensors it reuses (the 16-bit kernel's tile counters, a zero bias).
struct Step {
  CUfunction kernel;
  std::array<unsigned, 3> grid;
  unsigned block, smem;
};

struct FusedPlan {
  int64_t kind;
  std::vector<Step> steps;
  std::vector<int64_t> sizes;
  Tensor counters, zero_bias;
};

constexpr int64_t KIND_FUSED16 = 1, KIND_FUSED32 = 2, KIND_SM90 = 3;

// Python keeps a record of what it handed over and clears both together (ops/launch/direct.py: NativePlans).
std::mutex plans_lock;
std::unordered_map<Key, FwdPlan, KeyHash> fwd_plans;
std::unordered_map<Key, BwdPlan, KeyHash> bwd_plans;
std::unordered_map<Key, bool, KeyHash> linear_unfused;  // auto's (or the named) algo is "unfused"
std::unordered_map<Key, FusedPlan, KeyHash> fused_plans;
struct TransposePlan {   // copy_transposed's kernel and its geometry (ops/kernels/layernorm.mojo's, via Python)
  CUfunction kernel;
  int64_t tile, threads;
};
std::unordered_map<Key, TransposePlan, KeyHash> transpose_plans;   // by dtype and device
bool poison = false;   // tests: every output starts as NaN, so an unwritten element never passes

Key fwd_key(int64_t rows, int64_t h, at::ScalarType dtype, bool vec_ok, int64_t act, int64_t device) {
  return {rows, h, static_cast<int64_t>(dtype), vec_ok, act, device, 0, 0};
}

template <class Map>
std::optional<typename Map::mapped_type> find(Map& map, const Key& key) {
  std::lock_guard<std::mutex> guard(plans_lock);
  auto it = map.find(key);
  if (it == map.end()) return std::nullopt;
  return it->second;
}

constexpr int64_t VECTOR_BYTES = 16;

bool vec_ok(int64_t h, std::initializer_list<const Tensor*> tensors) {
  const int64_t width = VECTOR_BYTES / static_cast<int64_t>((*tensors.begin())->element_size());
  if (h % width) return false;
  uintptr_t address = 0;
  for (const Tensor* t : tensors) address |= reinterpret_cast<uintptr_t>(t->data_ptr());
  return address % VECTOR_BYTES == 0;
}

Tensor empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  Tensor t = at::empty(shape, options);
  if (poison) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

// Row `row` of a contiguous float32 [2, rows] statistics buffer, by address.
void* stat_row(const Tensor& stats, int64_t row) { return static_cast<float*>(stats.data_ptr()) + row * stats.size(1); }

bool supported(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

// Tensors our kernels may read as they are: none a tensor subclass (a FakeTensor, a DTensor: the Python key), a
// functorch transform's wrapper (vmap, grad), legacy vmap's batched tensor (dy in the backward of
// autograd.grad(is_grads_batched=True), as jacobian(vectorize=True) makes), functionalized, nested or sparse, none a
// view whose memory holds the negated or conjugated values (z.conj().imag) or an efficient zero tensor (no memory);
// no TorchDispatchMode active (it would not see the kernels) and no forward-mode AD level open (our autograd has no
// forward-mode rule). Python answers the rest with torch's ops (ops/inputs.py: torch_answers).
constexpr c10::DispatchKeySet UNPLAIN_KEYS =
    c10::python_ks | c10::functorch_transforms_ks | c10::DispatchKeySet(c10::DispatchKey::Functionalize) |
    c10::DispatchKeySet(c10::DispatchKey::Batched) | c10::DispatchKeySet(c10::DispatchKey::NestedTensor) |
    c10::DispatchKeySet(c10::DispatchKey::Sparse) | c10::DispatchKeySet(c10::DispatchKey::SparseCsr) |
    c10::DispatchKeySet(c10::DispatchKey::Negative) | c10::DispatchKeySet(c10::DispatchKey::Conjugate) |
    c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);

bool plain(std::initializer_list<const Tensor*> tensors) {
  if (c10::impl::TorchDispatchModeTLS::any_modes_set() || torch::autograd::ForwardADLevel::try_get_by_idx(0))
    return false;   // a dispatch mode, or forward-mode AD's level (forward_ad.dual_level) open
  for (const Tensor* t : tensors)
    if (t->defined() && t->key_set().has_any(UNPLAIN_KEYS)) return false;
  return true;
}

// The kernels take rows and row lengths as int32 (their element offsets are 64-bit): a call with a larger one goes
// back to Python (ops/inputs.py: beyond_int32), which names it or has torch's ops answer it.
constexpr int64_t INT32_LIMIT = 2147483647;

// The mirror of Python's LayerNorm classifier (ops/layernorm/checks.py: classify): whether our kernels take x, w, b
// as they come ("kernels"): non-empty contiguous CPU or CUDA tensors of one supported dtype on one device, none that
// torch's ops answer instead (plain), weight and bias [H] with H x's last dim, rows and H in int32, not under CUDA
// autocast on a CUDA GPU. With any_layout, x may be strided (see dense). tests/test_classify.py compares the two.
bool accepts(const Tensor& x, const Tensor& w, const Tensor& b, bool any_layout = false) {
  // plain first: a nested or sparse x is not asked for its sizes
  if (!plain({&x, &w, &b}) || !(x.is_cuda() || x.is_cpu()) || x.dim() < 1 || x.numel() == 0 ||
      (x.is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA)))
    return false;
  const auto dtype = x.scalar_type();
  const int64_t h = x.size(-1);
  if (h > INT32_LIMIT || x.numel() / h > INT32_LIMIT) return false;
  return supported(dtype) && w.scalar_type() == dtype && b.scalar_type() == dtype && w.device() == x.device() &&
         b.device() == x.device() && w.dim() == 1 && b.dim() == 1 && w.size(0) == h && b.size(0) == h &&
         (any_layout || x.is_contiguous()) && w.is_contiguous() && b.is_contiguous();
}

// What the C++ route takes: a call accepts() takes, on a CUDA GPU (Python runs the CPU's).
bool takes(const Tensor& x, const Tensor& w, const Tensor& b, bool any_layout = false) {
  return x.is_cuda() && accepts(x, w, b, any_layout);
}

// Whether a Linear's weight [N, K] and bias [N] (or none) suit x [..., K]: x's dtype and device, contiguous (with
// transposed, the weight may also be the transpose of a contiguous [K, N]).
bool linear_takes(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, bool transposed = false) {
  const auto dtype = x.scalar_type();
  if (!plain({&x, &w, bias.has_value() ? &*bias : &w}) || w.scalar_type() != dtype || w.device() != x.device() ||
      w.dim() != 2 || w.size(1) != x.size(-1) || w.size(0) == 0 || w.size(0) > INT32_LIMIT ||
      !(w.is_contiguous() || (transposed && w.t().is_contiguous())))
    return false;
  if (!bias.has_value() || !bias->defined()) return true;
  return bias->scalar_type() == dtype && bias->device() == x.device() && bias->dim() == 1 &&
         bias->size(0) == w.size(0) && bias->is_contiguous();
}

// The mirror of Python's LayerNorm+Linear classifier (ops/layernorm_linear/checks.py: classify): the LayerNorm's
// accepts, the Linear's linear_takes, and no autocast on x's device (it would cast the Linear's parameters).
bool linear_accepts(const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w,
                    const std::optional<Tensor>& bias, bool any_layout = false, bool transposed = false) {
  return accepts(x, lnw, lnb, any_layout) && linear_takes(x, w, bias, transposed) &&
         !at::autocast::is_autocast_enabled(x.device().type());
}
