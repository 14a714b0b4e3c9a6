// The direct launcher's host side in C++ (ops/launch/direct.py builds and loads it): LayerNorm (+GELU) and the
// unfused LayerNorm+Linear as torch operators with C++ autograd, and the fused and Hopper LayerNorm+Linear
// forwards (no gradient), so that an eager call costs what a torch op costs (allocation, launch and the
// backward's autograd node in C++, no Python per call).
//
// It decides nothing: Python (ops/layernorm/config.py, ops/layernorm_linear/config.py) chooses every launch and
// hands each choice to the plan tables below (set_fwd_plan, set_bwd_plan, set_linear_algo, set_fused_plan) the
// first time it sees a shape. A strided x is copied once (dense). An op returns an undefined tensor (None in
// Python) for any call it does not take: no plan yet, a strided weight or bias, an empty x, tensors on the CPU or
// of another dtype, an eps that is not positive.
// Python then runs its own route, with its named errors, and registers the plan for the next call.
// layernorm_fwd / layernorm_infer / layernorm_bwd (with COMPILED_LAYERNORM "ours") and layernorm_linear_infer are
// the ops torch.compile's graphs call (fakes in ops/layernorm/, ops/layernorm_linear/); they, and the autograd
// backward, fall back to the torch.library ops mojo::layernorm_fwd, mojo::layernorm_bwd and
// mojo::layernorm_linear_fwd through the dispatcher. Design note: docs/direct_launch.md.
// Kernels are launched with the driver's cuLaunchKernel(Ex), and the unfused route's Linear runs on cuBLASLt, both
// found with dlsym (no CUDA headers needed), on torch's current stream of the tensors' device.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Triple = std::tuple<Tensor, Tensor, Tensor>;

// ---------------------------------------------------------------- the driver API, by dlsym

using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using LaunchKernel = int (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
constexpr int CUDA_ERROR_INVALID_CONTEXT = 201;
constexpr int CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;

struct LaunchAttribute {  // CUlaunchAttribute
  int id;
  char pad[4];
  union {
    struct { unsigned x, y, z; } cluster;
    int programmatic;  // programmaticStreamSerializationAllowed
    char bytes[64];
  } value;
};

struct LaunchConfig {  // CUlaunchConfig
  unsigned grid[3];
  unsigned block[3];
  unsigned smem;
  CUstream stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};

using LaunchKernelEx = int (*)(const LaunchConfig*, CUfunction, void**, void**);

struct alignas(64) TensorMap {  // CUtensorMap: 128 opaque bytes the driver fills
  uint64_t opaque[16];
};

// cuTensorMapEncodeTiled(map, data type, rank, address, dims, strides, box, element strides, interleave,
// swizzle, L2 promotion, out-of-bounds fill)
using TensorMapEncodeTiled = int (*)(TensorMap*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                                     const unsigned*, const unsigned*, int, int, int, int);

struct Driver {
  LaunchKernel launch = nullptr;
  LaunchKernelEx launch_ex = nullptr;
  int (*device_get)(int*, int) = nullptr;
  int (*primary_ctx_retain)(CUcontext*, int) = nullptr;
  int (*ctx_set_current)(CUcontext) = nullptr;
  int (*error_string)(int, const char**) = nullptr;
  TensorMapEncodeTiled encode_tiled = nullptr;
  int (*stream_is_capturing)(CUstream, int*) = nullptr;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) return;
    launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    launch_ex = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    device_get = reinterpret_cast<int (*)(int*, int)>(dlsym(lib, "cuDeviceGet"));
    primary_ctx_retain = reinterpret_cast<int (*)(CUcontext*, int)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    ctx_set_current = reinterpret_cast<int (*)(CUcontext)>(dlsym(lib, "cuCtxSetCurrent"));
    error_string = reinterpret_cast<int (*)(int, const char**)>(dlsym(lib, "cuGetErrorString"));
    encode_tiled = reinterpret_cast<TensorMapEncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
    stream_is_capturing = reinterpret_cast<int (*)(CUstream, int*)>(dlsym(lib, "cuStreamIsCapturing"));
  }
};

const Driver& driver() {
  static const Driver d;
  TORCH_CHECK(d.launch != nullptr && d.launch_ex != nullptr, "mojo_direct: libcuda.so.1 not found");
  return d;
}

// Make the device's primary context (torch's) current on this thread, for a thread torch has not made it
// current on yet.
void set_primary_context(int index) {
  const Driver& d = driver();
  int dev = 0;
  CUcontext ctx = nullptr;
  if (d.device_get(&dev, index) == 0 && d.primary_ctx_retain(&ctx, dev) == 0) d.ctx_set_current(ctx);
}

void check(int err) {
  if (err == 0) return;
  const char* text = nullptr;
  if (driver().error_string != nullptr) driver().error_string(err, &text);
  TORCH_CHECK(false, "mojo_direct: CUDA driver error ", err, ": ", text ? text : "unknown");
}

// torch's current stream of `device`, and its CUDA handle.
c10::Stream torch_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

CUstream current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStreamNativeHandle(torch_stream(device));
}

// Whether torch's current stream of `device` is being captured into a CUDA graph (CU_STREAM_CAPTURE_STATUS_ACTIVE).
bool capturing(const at::Device& device) {
  int status = 0;
  const auto is_capturing = driver().stream_is_capturing;
  return is_capturing != nullptr && is_capturing(current_stream(device), &status) == 0 && status == 1;
}

// One launch on torch's current stream of `device`; clusters > 1 launches grid[0] clusters of that many blocks.
// dependent: a programmatic dependent launch (PDL) of the stream's previous kernel, which its blocks may overlap
// until they run griddepcontrol.wait (the kernel must, before reading what that kernel writes).
void launch(const at::Device& device, CUfunction f, const std::array<unsigned, 3>& grid, unsigned block,
            unsigned clusters, void** params, unsigned smem = 0, bool dependent = false) {
  CUstream stream = current_stream(device);
  auto once = [&]() {
    if (clusters <= 1 && !dependent)
      return driver().launch(f, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, params, nullptr);
    LaunchAttribute attr{};
    if (dependent) {
      attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr.value.programmatic = 1;
    } else {
      attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attr.value.cluster = {clusters, 1, 1};
    }
    const unsigned blocks = grid[0] * (dependent ? 1 : clusters);
    LaunchConfig cfg{{blocks, grid[1], grid[2]}, {block, 1, 1}, smem, stream, &attr, 1};
    return driver().launch_ex(&cfg, f, params, nullptr);
  };
  int err = once();
  if (err == CUDA_ERROR_INVALID_CONTEXT) {
    set_primary_context(device.index());
    err = once();
  }
  check(err);
}

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
std::unordered_map<Key, CUfunction, KeyHash> transpose_kernels;   // copy_transposed, by dtype and device
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
// autograd.grad(is_grads_batched=True), as jacobian(vectorize=True) makes), functionalized or a forward-mode AD dual
// (our autograd has no forward-mode rule), none nested or sparse, none a view whose memory holds the negated or
// conjugated values (z.conj().imag) or an efficient zero tensor (no memory), and no TorchDispatchMode active (it
// would not see the kernels). Python answers the rest with torch's ops (ops/layernorm/: torch_answers).
constexpr c10::DispatchKeySet UNPLAIN_KEYS =
    c10::python_ks | c10::functorch_transforms_ks | c10::DispatchKeySet(c10::DispatchKey::Functionalize) |
    c10::DispatchKeySet(c10::DispatchKey::Batched) | c10::DispatchKeySet(c10::DispatchKey::NestedTensor) |
    c10::DispatchKeySet(c10::DispatchKey::Sparse) | c10::DispatchKeySet(c10::DispatchKey::SparseCsr) |
    c10::DispatchKeySet(c10::DispatchKey::Negative) | c10::DispatchKeySet(c10::DispatchKey::Conjugate) |
    c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);

bool plain(std::initializer_list<const Tensor*> tensors) {
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return false;
  for (const Tensor* t : tensors)
    if (t->defined() && (t->key_set().has_any(UNPLAIN_KEYS) || t->_fw_grad(0).defined())) return false;
  return true;
}

// The kernels take rows and row lengths as int32 (their element offsets are 64-bit): a call with a larger one goes
// back to Python (layernorm.kernels_cannot_read), which names it or has torch's ops answer it.
constexpr int64_t INT32_LIMIT = 2147483647;

// What the C++ route takes: non-empty contiguous CUDA tensors of one supported dtype on one device, weight and
// bias [H] with H x's last dim (Python's layernorm._valid), rows and H in int32, and a positive eps; not under CUDA
// autocast (Python follows torch's autocast policy there). With any_layout, x may be strided (see dense).
bool takes(const Tensor& x, const Tensor& w, const Tensor& b, double eps, bool any_layout = false) {
  if (!x.is_cuda() || x.dim() < 1 || x.numel() == 0 || !(eps > 0) || at::autocast::is_autocast_enabled(at::kCUDA) ||
      !plain({&x, &w, &b}))
    return false;
  const auto dtype = x.scalar_type();
  const int64_t h = x.size(-1);
  if (h > INT32_LIMIT || x.numel() / h > INT32_LIMIT) return false;
  return supported(dtype) && w.scalar_type() == dtype && b.scalar_type() == dtype && w.device() == x.device() &&
         b.device() == x.device() && w.dim() == 1 && b.dim() == 1 && w.size(0) == h && b.size(0) == h &&
         (any_layout || x.is_contiguous()) && w.is_contiguous() && b.is_contiguous();
}

// Whether a Linear's weight [N, K] and bias [N] (or none) suit x [..., K]: x's dtype and device, contiguous.
bool linear_takes(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
  const auto dtype = x.scalar_type();
  if (!plain({&x, &w, bias.has_value() ? &*bias : &w}) || w.scalar_type() != dtype || w.device() != x.device() ||
      w.dim() != 2 || w.size(1) != x.size(-1) || w.size(0) == 0 || w.size(0) > INT32_LIMIT || !w.is_contiguous())
    return false;
  if (!bias.has_value() || !bias->defined()) return true;
  return bias->scalar_type() == dtype && bias->device() == x.device() && bias->dim() == 1 &&
         bias->size(0) == w.size(0) && bias->is_contiguous();
}

// ---------------------------------------------------------------- the Linear's GEMMs by cuBLASLt, by dlsym

// The unfused route's three GEMMs (y = xn W^T + bias; dxn = dy W; dW = dy^T xn with db, dy's column sums, in the
// same GEMM's epilogue) go to cuBLASLt with a descriptor and an algorithm chosen once per shape. torch's addmm
// and mm ask cuBLAS's heuristics on every call, and its bias gradient is a separate reduction: together they are
// most of a training step's host time (docs/direct_launch.md). 16-bit only (float32 keeps torch's ops and TF32
// settings), pointers 256-byte aligned (the heuristics' default assumption), torch's reduced-precision setting
// honoured; anything else, or a shape cuBLASLt has no algorithm for, runs torch's ops.
using LtHandle = void*;
using LtObject = void*;   // a matmul descriptor, matrix layout or preference
struct LtAlgo { uint64_t data[8]; };
struct LtHeuristic { LtAlgo algo; size_t workspace; int state; float waves; int reserved[4]; };

constexpr int CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14, CUBLAS_COMPUTE_32F = 68;
constexpr int LT_DESC_TRANSA = 3, LT_DESC_TRANSB = 4, LT_DESC_EPILOGUE = 7, LT_DESC_BIAS_POINTER = 8,
              LT_DESC_AUX_POINTER = 11, LT_DESC_AUX_LD = 12;
constexpr int LT_PREF_MAX_WORKSPACE = 1, LT_PREF_REDUCTION_MASK = 3;
constexpr uint32_t LT_EPILOGUE_DEFAULT = 1, LT_EPILOGUE_BIAS = 4, LT_EPILOGUE_GELU = 32, LT_EPILOGUE_GELU_BIAS = 36,
                   LT_EPILOGUE_GELU_AUX = 160, LT_EPILOGUE_GELU_AUX_BIAS = 164, LT_EPILOGUE_BGRADB = 512;
constexpr uint64_t LT_MAX_WORKSPACE = 32ull << 20;
constexpr uintptr_t LT_ALIGN = 256;

struct CublasLt {
  int (*create)(LtHandle*) = nullptr;
  int (*desc_create)(LtObject*, int, int) = nullptr;
  int (*desc_set)(LtObject, int, const void*, size_t) = nullptr;
  int (*desc_destroy)(LtObject) = nullptr;
  int (*layout_destroy)(LtObject) = nullptr;
  int (*layout_create)(LtObject*, int, uint64_t, uint64_t, int64_t) = nullptr;
  int (*pref_create)(LtObject*) = nullptr;
  int (*pref_set)(LtObject, int, const void*, size_t) = nullptr;
  int (*pref_destroy)(LtObject) = nullptr;
  int (*heuristic)(LtHandle, LtObject, LtObject, LtObject, LtObject, LtObject, LtObject, int, LtHeuristic*,
                   int*) = nullptr;
  int (*matmul)(LtHandle, LtObject, const void*, const void*, LtObject, const void*, LtObject, const void*,
                const void*, LtObject, void*, LtObject, const LtAlgo*, void*, size_t, CUstream) = nullptr;

  CublasLt() {
    void* lib = nullptr;   // the one torch loaded, else any
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) != nullptr) break;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12"})
      if (lib == nullptr) lib = dlopen(name, RTLD_NOW);
    const char* off = std::getenv("OPS_CUBLASLT");   // 0: torch's ops (an A/B; docs/direct_launch.md)
    if (lib == nullptr || (off != nullptr && std::string(off) == "0")) return;
    create = reinterpret_cast<decltype(create)>(dlsym(lib, "cublasLtCreate"));
    desc_create = reinterpret_cast<decltype(desc_create)>(dlsym(lib, "cublasLtMatmulDescCreate"));
    desc_set = reinterpret_cast<decltype(desc_set)>(dlsym(lib, "cublasLtMatmulDescSetAttribute"));
    desc_destroy = reinterpret_cast<decltype(desc_destroy)>(dlsym(lib, "cublasLtMatmulDescDestroy"));
    layout_destroy = reinterpret_cast<decltype(layout_destroy)>(dlsym(lib, "cublasLtMatrixLayoutDestroy"));
    layout_create = reinterpret_cast<decltype(layout_create)>(dlsym(lib, "cublasLtMatrixLayoutCreate"));
    pref_create = reinterpret_cast<decltype(pref_create)>(dlsym(lib, "cublasLtMatmulPreferenceCreate"));
    pref_set = reinterpret_cast<decltype(pref_set)>(dlsym(lib, "cublasLtMatmulPreferenceSetAttribute"));
    pref_destroy = reinterpret_cast<decltype(pref_destroy)>(dlsym(lib, "cublasLtMatmulPreferenceDestroy"));
    heuristic = reinterpret_cast<decltype(heuristic)>(dlsym(lib, "cublasLtMatmulAlgoGetHeuristic"));
    matmul = reinterpret_cast<decltype(matmul)>(dlsym(lib, "cublasLtMatmul"));
  }
  bool ok() const {
    return create && desc_create && desc_set && desc_destroy && layout_destroy && layout_create && pref_create &&
           pref_set && pref_destroy && heuristic && matmul;
  }
};

const CublasLt* cublas_lt() {
  static const CublasLt lt;
  return lt.ok() ? &lt : nullptr;
}

// A GEMM D = op(A) op(B) (+ epilogue) in cuBLAS's column-major terms, chosen once; `lock` guards the bias pointer
// set on the shared descriptor until the call is enqueued.
struct GemmPlan {
  LtHandle handle = nullptr;
  LtObject desc = nullptr, a = nullptr, b = nullptr, d = nullptr;
  LtAlgo algo;
  size_t workspace;
  std::mutex lock;
};

enum GemmKind : int64_t { GEMM_FWD = 0, GEMM_FWD_BIAS = 1, GEMM_DGRAD = 2, GEMM_WGRAD = 3, GEMM_WGRAD_BGRAD = 4,
                          GEMM_FWD_GELU = 5, GEMM_FWD_BIAS_GELU = 6, GEMM_FWD_GELU_AUX = 7, GEMM_FWD_BIAS_GELU_AUX = 8 };

bool forward_gemm(int64_t kind) { return kind <= GEMM_FWD_BIAS || kind >= GEMM_FWD_GELU; }

// The cuBLASLt epilogue of a GEMM of `kind`: the bias added, GELU (its tanh form) applied (with AUX: GELU's input
// written too, for the backward), the bias gradient summed.
uint32_t gemm_epilogue(int64_t kind) {
  switch (kind) {
    case GEMM_FWD_BIAS: return LT_EPILOGUE_BIAS;
    case GEMM_FWD_GELU: return LT_EPILOGUE_GELU;
    case GEMM_FWD_BIAS_GELU: return LT_EPILOGUE_GELU_BIAS;
    case GEMM_FWD_GELU_AUX: return LT_EPILOGUE_GELU_AUX;
    case GEMM_FWD_BIAS_GELU_AUX: return LT_EPILOGUE_GELU_AUX_BIAS;
    case GEMM_WGRAD_BGRAD: return LT_EPILOGUE_BGRADB;
    default: return LT_EPILOGUE_DEFAULT;
  }
}

std::mutex gemm_lock;
std::unordered_map<Key, std::unique_ptr<GemmPlan>, KeyHash> gemm_plans;   // null: torch's ops for that key
constexpr size_t GEMM_PLANS_MAX = 4096;   // beyond it, new shapes run torch's ops

template <class T>
int64_t reduction_option(T v) {   // torch's bool (older) or CuBLASReductionOption: 0 allows reduced precision
  if constexpr (std::is_same_v<T, bool>) return v ? 0 : 1;
  else return static_cast<int64_t>(v);
}

LtHandle lt_handle(int64_t device) {
  static std::unordered_map<int64_t, LtHandle> handles;   // under gemm_lock
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  LtHandle h = nullptr;
  if (cublas_lt()->create(&h) != 0) h = nullptr;
  handles[device] = h;
  return h;
}

// The forward GEMM asks for no workspace where k <= n * lt_no_workspace_k_per_n (layernorm_linear_config.py's
// lt_without_workspace; its LT_NO_WORKSPACE_MAX_K_PER_N is handed over at loading, 0 until then: every GEMM as
// the heuristics like).
std::atomic<int64_t> lt_no_workspace_k_per_n{0};

void set_gemm_tuning(int64_t no_workspace_k_per_n) { lt_no_workspace_k_per_n = no_workspace_k_per_n; }

// The most workspace the algorithm of a GEMM of `kind` may ask for: none for a forward in the rule above, else
// LT_MAX_WORKSPACE; OPS_LT_WORKSPACE=<bytes> sets every GEMM's (an A/B switch, read once per process).
uint64_t lt_max_workspace(int64_t kind, int64_t n, int64_t k) {
  static const int64_t forced = [] {
    const char* v = std::getenv("OPS_LT_WORKSPACE");
    return v == nullptr ? int64_t(-1) : static_cast<int64_t>(std::stoull(v));
  }();
  if (forced >= 0) return static_cast<uint64_t>(forced);
  return forward_gemm(kind) && k <= n * lt_no_workspace_k_per_n.load() ? 0 : LT_MAX_WORKSPACE;
}

// The plan of a [rows x cols] D from A [k x rows] (or its transpose) and B, m/n/k in cuBLAS's terms, or none.
std::unique_ptr<GemmPlan> make_gemm_plan(int64_t kind, int dtype, int64_t m, int64_t n, int64_t k, int64_t device,
                                         int64_t reduction) {
  const CublasLt& lt = *cublas_lt();
  auto plan = std::make_unique<GemmPlan>();
  struct Discard {   // a plan not returned gives its descriptor and layouts back
    const CublasLt& lt;
    GemmPlan* plan;
    bool keep = false;
    ~Discard() {
      if (keep) return;
      for (LtObject o : {plan->a, plan->b, plan->d})
        if (o != nullptr) lt.layout_destroy(o);
      if (plan->desc != nullptr) lt.desc_destroy(plan->desc);
    }
  } discard{lt, plan.get()};
  plan->handle = lt_handle(device);
  if (plan->handle == nullptr || lt.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != 0) return nullptr;
  // fwd: D[N, M] = W[K, N]^T xn[K, M]; dgrad: dxn[K, M] = W[K, N] dy[N, M]; wgrad: dW[K, N] = xn[K, M] dy[N, M]^T
  const bool wgrad = kind == GEMM_WGRAD || kind == GEMM_WGRAD_BGRAD;
  const int32_t ta = forward_gemm(kind) ? 1 : 0, tb = wgrad ? 1 : 0;
  const uint32_t epilogue = gemm_epilogue(kind);
  void* aligned = reinterpret_cast<void*>(LT_ALIGN);   // the heuristics read the bias pointer's alignment only
  lt.desc_set(plan->desc, LT_DESC_TRANSA, &ta, sizeof(ta));
  lt.desc_set(plan->desc, LT_DESC_TRANSB, &tb, sizeof(tb));
  lt.desc_set(plan->desc, LT_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  if (epilogue == LT_EPILOGUE_BIAS || epilogue == LT_EPILOGUE_GELU_BIAS || epilogue == LT_EPILOGUE_GELU_AUX_BIAS ||
      epilogue == LT_EPILOGUE_BGRADB)
    lt.desc_set(plan->desc, LT_DESC_BIAS_POINTER, &aligned, sizeof(aligned));
  if (epilogue == LT_EPILOGUE_GELU_AUX || epilogue == LT_EPILOGUE_GELU_AUX_BIAS) {   // GELU's input, laid out as D
    const int64_t ld = m;
    lt.desc_set(plan->desc, LT_DESC_AUX_POINTER, &aligned, sizeof(aligned));
    lt.desc_set(plan->desc, LT_DESC_AUX_LD, &ld, sizeof(ld));
  }
  // A is [k x m] stored (transposed: op(A) = A^T is m x k), B [k x n] (or [n x k] with tb), D [m x n]
  if (lt.layout_create(&plan->a, dtype, ta ? k : m, ta ? m : k, ta ? k : m) != 0 ||
      lt.layout_create(&plan->b, dtype, tb ? n : k, tb ? k : n, tb ? n : k) != 0 ||
      lt.layout_create(&plan->d, dtype, m, n, m) != 0)
    return nullptr;
  LtObject pref = nullptr;
  if (lt.pref_create(&pref) != 0) return nullptr;
  // fwd: m = N, k = K (y^T = W xn^T in cuBLAS's column-major terms)
  const uint64_t workspace = lt_max_workspace(kind, m, k);
  // torch's setting as its own cuBLASLt calls map it: split-K reductions in any type (INPLACE and OUTPUT_TYPE
  // reduce in the output's 16-bit type), only in float32 (COMPUTE_TYPE), or none (no split-K)
  const uint32_t mask = reduction == 0 ? 7u : reduction == 1 ? 2u : 0u;
  lt.pref_set(pref, LT_PREF_MAX_WORKSPACE, &workspace, sizeof(workspace));
  lt.pref_set(pref, LT_PREF_REDUCTION_MASK, &mask, sizeof(mask));
  LtHeuristic found{};
  int count = 0;
  const int err = lt.heuristic(plan->handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &found, &count);
  lt.pref_destroy(pref);
  if (err != 0 || count < 1 || found.state != 0) return nullptr;
  plan->algo = found.algo;
  plan->workspace = found.workspace;
  discard.keep = true;
  return plan;
}

GemmPlan* gemm_plan(int64_t kind, at::ScalarType dtype, int64_t m, int64_t n, int64_t k, int64_t device) {
  const auto& ctx = at::globalContext();
  const int64_t reduction = reduction_option(dtype == at::kHalf ? ctx.allowFP16ReductionCuBLAS()
                                                                : ctx.allowBF16ReductionCuBLAS());
  const Key key{kind, m, n, k, static_cast<int64_t>(dtype), device, reduction, 2};
  std::lock_guard<std::mutex> guard(gemm_lock);
  auto it = gemm_plans.find(key);
  if (it != gemm_plans.end()) return it->second.get();
  if (gemm_plans.size() >= GEMM_PLANS_MAX) return nullptr;
  auto plan = make_gemm_plan(kind, dtype == at::kHalf ? CUDA_R_16F : CUDA_R_16BF, m, n, k, device, reduction);
  return (gemm_plans[key] = std::move(plan)).get();
}

bool lt_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % LT_ALIGN) return false;
  return true;
}

// Whether cuBLASLt may take a GEMM of these tensors: all in the first's 16-bit dtype on its CUDA device,
// contiguous, not empty (the callers check the shapes).
bool lt_takes(std::initializer_list<const Tensor*> tensors) {
  const Tensor& first = **tensors.begin();
  const auto dtype = first.scalar_type();
  if (cublas_lt() == nullptr || !first.is_cuda() || (dtype != at::kHalf && dtype != at::kBFloat16) ||
      !plain(tensors))
    return false;
  for (const Tensor* t : tensors)
    if (t->scalar_type() != dtype || t->device() != first.device() || !t->is_contiguous() || t->numel() == 0)
      return false;
  return true;
}

Tensor gemm_workspace(const GemmPlan& plan, const at::Device& device) {
  if (!plan.workspace) return Tensor();
  return at::empty({static_cast<int64_t>(plan.workspace)}, at::TensorOptions().dtype(at::kByte).device(device));
}

// One cuBLASLt call on torch's current stream; its workspace from `workspace` (the plan's size, allocated by the
// caller on the stream that owns it) or, undefined, allocated here.
void run_gemm(GemmPlan& plan, const void* a, const void* b, void* d, void* bias, const at::Device& device,
              Tensor workspace = Tensor(), void* aux = nullptr) {
  const CublasLt& lt = *cublas_lt();
  CUstream stream = current_stream(device);
  if (plan.workspace && !workspace.defined()) workspace = gemm_workspace(plan, device);
  const float one = 1.0f, zero = 0.0f;
  std::lock_guard<std::mutex> guard(plan.lock);
  if (bias != nullptr) lt.desc_set(plan.desc, LT_DESC_BIAS_POINTER, &bias, sizeof(bias));
  if (aux != nullptr) lt.desc_set(plan.desc, LT_DESC_AUX_POINTER, &aux, sizeof(aux));
  const int err = lt.matmul(plan.handle, plan.desc, &one, a, plan.a, b, plan.b, &zero, d, plan.d, d, plan.d,
                            &plan.algo, plan.workspace ? workspace.data_ptr() : nullptr, plan.workspace, stream);
  TORCH_CHECK(err == 0, "mojo_direct: cublasLtMatmul failed with status ", err);
}

enum LinearAct { ACT_NONE, ACT_GELU, ACT_GELU_AUX };

// y = xn W^T + bias, shaped [..., N] like xn [..., K]; with ACT_GELU GELU's tanh form applied to it (in the
// epilogue, before y is rounded to its dtype), with ACT_GELU_AUX also GELU's input h (rounded) for the backward.
// torch's ops where cuBLASLt does not take it (GELU's input needs N a multiple of 8 there).
std::tuple<Tensor, Tensor> linear_act(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias,
                                      LinearAct act) {
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t n = w.size(0), k = w.size(1);
  auto by_torch = [&]() -> std::tuple<Tensor, Tensor> {
    Tensor h = at::linear(xn, w, bias);
    if (act == ACT_NONE) return {h, Tensor()};
    return {at::gelu(h, "tanh"), act == ACT_GELU_AUX ? h : Tensor()};
  };
  if (!linear_takes(xn, w, bias) || !lt_takes({&xn, &w}) || (act == ACT_GELU_AUX && n % 8 != 0) ||
      !lt_aligned({xn.data_ptr(), w.data_ptr(), has_bias ? bias->data_ptr() : nullptr}))
    return by_torch();
  const int64_t rows = xn.numel() / k;
  c10::DeviceGuard guard(xn.device());
  const int64_t kind = act == ACT_NONE ? (has_bias ? GEMM_FWD_BIAS : GEMM_FWD)
                       : act == ACT_GELU ? (has_bias ? GEMM_FWD_BIAS_GELU : GEMM_FWD_GELU)
                                         : (has_bias ? GEMM_FWD_BIAS_GELU_AUX : GEMM_FWD_GELU_AUX);
  GemmPlan* plan = gemm_plan(kind, xn.scalar_type(), n, rows, k, xn.get_device());
  if (plan == nullptr) return by_torch();
  std::vector<int64_t> shape(xn.sizes().begin(), xn.sizes().end());
  shape.back() = n;
  Tensor y = empty(shape, xn.options());
  Tensor h = act == ACT_GELU_AUX ? empty(shape, xn.options()) : Tensor();
  run_gemm(*plan, w.data_ptr(), xn.data_ptr(), y.data_ptr(), has_bias ? bias->data_ptr() : nullptr, xn.device(),
           Tensor(), h.defined() ? h.data_ptr() : nullptr);
  return {y, h};
}

Tensor linear_forward(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias) {
  return std::get<0>(linear_act(xn, w, bias, ACT_NONE));
}

// gelu(linear(xn, W, bias), approximate="tanh") in one GEMM: what ops/layernorm_linear/inductor.py puts in an
// inference graph in place of linear and the GELU after it.
Tensor linear_gelu(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias) {
  return std::get<0>(linear_act(xn, w, bias, ACT_GELU));
}

// traced_linear_gelu's forward below autograd: (gelu(h), h) with h = xn W^T + bias.
std::tuple<Tensor, Tensor> linear_gelu_aux(const Tensor& xn, const Tensor& w, const std::optional<Tensor>& bias) {
  return linear_act(xn, w, bias, ACT_GELU_AUX);
}

// The Linear's backward from contiguous dy [..., N] and xn [..., K], in two parts that may run on different
// streams: input() gives dxn = dy W (shaped like xn); weights() fills dw = dy^T xn and, where asked, db = dy's
// column sums (else undefined; db in dW's epilogue where both are). Each by cuBLASLt, else by torch's mm or sum.
// Where cuBLASLt takes the weights' GEMM (`wgrad` set), the constructor allocates its outputs and workspace on the
// current stream, so that weights() may run on a side stream that joins back before they are read.
struct LinearBackward {
  const Tensor& dy;
  const Tensor& xn;
  const Tensor& w;
  bool weight_grad, bias_grad, lt;
  GemmPlan* wgrad = nullptr;
  Tensor dw, db, workspace;

  LinearBackward(const Tensor& dy_, const Tensor& xn_, const Tensor& w_, bool weight_grad_, bool bias_grad_)
      : dy(dy_), xn(xn_), w(w_), weight_grad(weight_grad_), bias_grad(bias_grad_) {
    const int64_t n = w.size(0), k = w.size(1);
    lt = w.dim() == 2 && lt_takes({&dy, &xn, &w}) && dy.numel() == xn.numel() / k * n &&
         lt_aligned({dy.data_ptr(), xn.data_ptr(), w.data_ptr()});
    if (!weight_grad || !lt) return;
    wgrad = gemm_plan(bias_grad ? GEMM_WGRAD_BGRAD : GEMM_WGRAD, xn.scalar_type(), k, n, xn.numel() / k,
                      xn.get_device());
    if (wgrad == nullptr) return;
    dw = empty(w.sizes(), w.options());
    if (bias_grad) db = empty({n}, w.options());
    workspace = gemm_workspace(*wgrad, xn.device());
  }

  Tensor input() const {
    const int64_t n = w.size(0), k = w.size(1);
    if (GemmPlan* dgrad = lt ? gemm_plan(GEMM_DGRAD, xn.scalar_type(), k, xn.numel() / k, n, xn.get_device())
                             : nullptr) {
      Tensor dxn = empty(xn.sizes(), xn.options());
      run_gemm(*dgrad, w.data_ptr(), dy.data_ptr(), dxn.data_ptr(), nullptr, xn.device());
      return dxn;
    }
    return dy.view({-1, n}).mm(w).view(xn.sizes());
  }

  void weights() {
    const int64_t n = w.size(0), k = w.size(1);
    if (wgrad != nullptr)
      run_gemm(*wgrad, xn.data_ptr(), dy.data_ptr(), dw.data_ptr(), bias_grad ? db.data_ptr() : nullptr,
               xn.device(), workspace);
    else if (weight_grad)
      dw = dy.view({-1, n}).t().mm(xn.view({-1, k}));
    if (bias_grad && !db.defined()) db = dy.view({-1, n}).sum(0);
  }
};

// Both parts, in order, on the current stream: (dxn, dw, db).
Triple linear_grads(const Tensor& dy, const Tensor& xn, const Tensor& w, bool weight_grad, bool bias_grad) {
  c10::DeviceGuard guard(xn.device());
  LinearBackward grads(dy, xn, w, weight_grad, bias_grad);
  Tensor dxn = grads.input();
  grads.weights();
  return {dxn, grads.dw, grads.db};
}

// Under CUDA graph capture, the unfused backward runs the weights' gradients on a side stream forked from the
// captured one, so that the graph runs them beside dxn's GEMM and the LayerNorm backward (layernorm_linear_config.py's
// CAPTURED_WEIGHT_GRADS_BESIDE, handed over at loading).
std::atomic<bool> captured_weight_grads_beside{false};

void set_capture_overlap(bool on) { captured_weight_grads_beside = on; }

// A stream of torch's pool, not `origin`, that waits for everything enqueued on `origin` so far.
c10::Stream fork_from(const c10::Stream& origin) {
  const auto* impl = c10::impl::getDeviceGuardImpl(origin.device_type());
  c10::Stream side = impl->getStreamFromGlobalPool(origin.device());
  if (side == origin) side = impl->getStreamFromGlobalPool(origin.device());   // the pool hands them out in turn
  c10::Event forked(origin.device_type());
  forked.record(origin);
  forked.block(side);
  return side;
}

// `origin` waits for everything enqueued on `side` so far.
void join(const c10::Stream& side, const c10::Stream& origin) {
  c10::Event done(side.device_type());
  done.record(side);
  done.block(origin);
}

// Under CUDA graph capture, our modules' parameters get their AccumulateGrad nodes (param.grad += g) made on
// streams of their own, so that the graph runs each parameter's accumulation as a branch beside the rest of the
// backward instead of in its chain (torch's engine runs an AccumulateGrad node on the stream current when the node
// was made, syncs it with the gradient's producer by an event, and joins it back at the end of the backward).
// Forwards of more than `accumulate_beside_max_rows` rows keep the capture stream (layernorm_linear_config.py's
// CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS, handed over at loading; 0: never). Eager calls never do: the events
// cost host time per parameter.
std::atomic<int64_t> accumulate_beside_max_rows{0};

void set_accumulate_beside(int64_t max_rows) { accumulate_beside_max_rows = max_rows; }

constexpr size_t ACCUMULATION_STREAMS = 4;

// ACCUMULATION_STREAMS streams of torch's high-priority pool for `device`, taken once (captures and fork_from take
// the low-priority pool, so these are never the captured stream or a backward's side stream).
const std::vector<c10::Stream>& accumulation_streams(const at::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<int64_t, std::vector<c10::Stream>> by_device;
  std::lock_guard<std::mutex> lock(mutex);
  auto& streams = by_device[device.index()];
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  while (streams.size() < ACCUMULATION_STREAMS)
    streams.push_back(impl->getStreamFromGlobalPool(device, /*isHighPriority=*/true));
  return streams;
}

// torch warns (once) when an AccumulateGrad node's stream is not its gradient's producer's, which here is the
// point. A backward whose forward made its nodes beside turns that warning off, and puts it back when the engine
// ends the backward (restore_accumulate_grad_warning, queued by accumulated_beside), if it was on.
std::atomic<bool> accumulate_grad_warning_off{false};

void restore_accumulate_grad_warning() {
  if (accumulate_grad_warning_off.exchange(false)) at::globalContext().setWarnOnAccumulateGradStreamMismatch(true);
}

using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<const Tensor&>()));

int64_t address(const Accumulator& node) { return reinterpret_cast<int64_t>(node.get()); }

// What accumulate_beside made for a forward: the AccumulateGrad nodes, which its caller holds until its autograd
// node does, and, where it made both the LayerNorm weight's and bias' nodes (its first two parameters), their
// streams and the two nodes: the backward may then leave their column sums on those streams (sums_streams).
struct Beside {
  std::vector<Accumulator> held;
  std::vector<c10::Stream> norm_streams;
  std::vector<int64_t> norm_nodes;   // by address
};

// The AccumulateGrad nodes of `params` (the leaves among them that need a gradient), each made on the next
// accumulation stream, when `rows` rows are captured with a gradient to come (one stream a parameter: with two
// parameters' adds in turn on one stream, the captured 1x128 step of bench_transformer was slower in an ad hoc
// A/B). A parameter whose node is alive already (used before in this forward, or held by DDP) keeps it and its
// stream. `captured`: capturing(device), where the caller has asked it already.
Beside accumulate_beside(const at::Device& device, int64_t rows, std::initializer_list<const Tensor*> params,
                         std::optional<bool> captured = std::nullopt) {
  Beside made;
  if (rows > accumulate_beside_max_rows || !at::GradMode::is_enabled() || !(captured ? *captured : capturing(device)))
    return made;
  const auto& streams = accumulation_streams(device);
  static std::atomic<size_t> turn{0};
  size_t position = 0;
  for (const Tensor* p : params) {
    const bool norm = position++ < 2;
    if (!p->defined() || !p->requires_grad() || !p->is_leaf()) continue;
    const c10::Stream stream = streams[turn++ % streams.size()];
    c10::StreamGuard on(stream);
    made.held.push_back(torch::autograd::impl::grad_accumulator(*p));
    if (norm && made.held.back()->stream() == stream) {
      made.norm_streams.push_back(stream);
      made.norm_nodes.push_back(address(made.held.back()));
    }
  }
  if (made.norm_nodes.size() < 2) made.norm_streams.clear();
  return made;
}

// A forward's record of what accumulate_beside made, for its backward.
void save_beside(AutogradContext* ctx, const Beside& beside) {
  ctx->saved_data["beside"] = !beside.held.empty();
  if (beside.norm_streams.empty()) return;
  std::vector<int64_t> packed;
  for (const auto& stream : beside.norm_streams) {
    const auto s = stream.pack3();
    packed.insert(packed.end(), {s.stream_id, s.device_index, static_cast<int64_t>(s.device_type)});
  }
  ctx->saved_data["sums_streams"] = packed;
  ctx->saved_data["sums_nodes"] = beside.norm_nodes;
}

// In a backward whose forward made its accumulators beside, run by the engine: the warning off until the engine
// ends the backward (the engine hands our gradients to the nodes beside after this backward returns).
void accumulated_beside(AutogradContext* ctx) {
  if (!ctx->saved_data["beside"].toBool() || torch::autograd::get_current_graph_task_id() == -1) return;
  if (at::globalContext().warnOnAccumulateGradStreamMismatch()) {
    at::globalContext().setWarnOnAccumulateGradStreamMismatch(false);
    accumulate_grad_warning_off = true;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(&restore_accumulate_grad_warning);
}

// The streams on which the LayerNorm weight's and bias' (w, b) gradients are accumulated, where the forward made
// both nodes there (save_beside) and they are still the ones that take them; else none. The backward may leave
// dweight and dbias ready on those streams (the sums on the first, the second waiting for them) rather than on its
// own, since their only consumers run there: torch's engine makes a consumer's stream wait for its producer's, and
// joins it into the caller's stream at the backward's end, both when it accumulates into .grad and when
// torch.autograd.grad captures the gradients.
std::vector<c10::Stream> sums_streams(AutogradContext* ctx, const Tensor& w, const Tensor& b) {
  const auto found = ctx->saved_data.find("sums_streams");
  if (found == ctx->saved_data.end()) return {};
  const auto nodes = ctx->saved_data["sums_nodes"].toIntVector();
  const Tensor* params[] = {&w, &b};
  for (size_t i = 0; i < 2; ++i) {
    auto node = torch::autograd::impl::try_get_grad_accumulator(*params[i]);
    if (!node || address(node) != nodes[i]) return {};
  }
  const auto s = found->second.toIntVector();
  std::vector<c10::Stream> streams;
  for (size_t i = 0; i + 2 < s.size(); i += 3)
    streams.push_back(c10::Stream::unpack3(s[i], static_cast<c10::DeviceIndex>(s[i + 1]),
                                           static_cast<c10::DeviceType>(s[i + 2])));
  return streams;
}

constexpr int64_t TRANSPOSE_TILE = 32, TRANSPOSE_THREADS = 256;   // ops/layernorm/config.py's, the kernel's
constexpr int64_t GRID_YZ_LIMIT = 65535;

// x [..., r, h] whose [r, h] matrices are column-major (stride(-2) 1, stride(-1) r; the leading dims one batch
// stride apart), as a transposed view of a [..., h, r] tensor is, copied row-major by copy_transposed, which
// reads and writes whole lines (torch's contiguous() moves these at a third of a plain copy's rate). None for
// any other layout, a gradient to come (torch's copy carries it back), or no kernel handed over.
std::optional<Tensor> copy_transposed(const Tensor& x) {
  const int64_t d = x.dim();
  if (d < 2 || (at::GradMode::is_enabled() && x.requires_grad())) return std::nullopt;
  const int64_t r = x.size(-2), h = x.size(-1);
  if (r < 2 || h < 2 || x.stride(-2) != 1 || x.stride(-1) != r) return std::nullopt;
  int64_t batches = 1, batch_stride = 0;
  for (int64_t i = d - 3; i >= 0; --i) {
    if (x.size(i) == 1) continue;
    if (batches == 1) batch_stride = x.stride(i);
    else if (x.stride(i) != batch_stride * batches) return std::nullopt;
    batches *= x.size(i);
  }
  const int64_t tiles_r = (r + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE;
  if (x.numel() > INT32_LIMIT || batch_stride > INT32_LIMIT || batch_stride * (batches - 1) + r * h > INT32_LIMIT ||
      tiles_r > GRID_YZ_LIMIT || batches > GRID_YZ_LIMIT)
    return std::nullopt;
  auto kernel = find(transpose_kernels, Key{static_cast<int64_t>(x.scalar_type()), x.get_device(), 0, 0, 0, 0, 0, 0});
  if (!kernel) return std::nullopt;
  Tensor y = empty(x.sizes(), x.options());
  void* yp = y.data_ptr();
  void* xp = x.data_ptr();
  int32_t r32 = static_cast<int32_t>(r), h32 = static_cast<int32_t>(h), stride32 = static_cast<int32_t>(batch_stride);
  void* params[] = {&yp, &xp, &r32, &h32, &stride32};
  const std::array<unsigned, 3> grid = {static_cast<unsigned>((h + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE),
                                        static_cast<unsigned>(tiles_r), static_cast<unsigned>(batches)};
  c10::DeviceGuard guard(x.device());
  launch(x.device(), *kernel, grid, TRANSPOSE_THREADS, 1, params, 0);
  return y;
}

// x as the kernels take it: a strided x of a call the C++ route takes otherwise is copied once (copy_transposed,
// or torch's contiguous(); with autograd, the copy's backward puts the gradient back in place, as Python's
// layernorm.adapt does); any other x as it is.
Tensor dense(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  if (!plain({&x}) || x.is_contiguous() || !takes(x, w, b, eps, true)) return x;   // a sparse x: no is_contiguous
  if (auto y = copy_transposed(x)) return *y;
  return x.contiguous();
}

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
  if (!takes(x, w, b, eps)) return std::nullopt;
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
// of a value per row, contiguous), or none. The benchmarks' tuning knobs send those calls to Python's route.
std::optional<BwdPlan> bwd_plan(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& b,
                                std::initializer_list<const Tensor*> stats, int64_t act) {
  const char* parts = std::getenv("OPS_LN_BWD_PARTS");
  const char* config = std::getenv("OPS_LN_BWD_CONFIG");
  if ((parts && *parts) || (config && *config)) return std::nullopt;
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
// `sums_on` (sums_streams), the sums run on its first stream, after the rows, and the others wait for them.
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
  if (act < 0 || act > 2 || !takes(x, w, b, 1.0)) return {};
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
  const Tensor x = dense(x_in, w, b, eps);
  auto plan = fwd_plan(x, w, b, eps, act);
  if (!plan) return Tensor();
  c10::DeviceGuard guard(x.device());
  if (!grad_to_come({&x, &w, &b})) return ln_fwd(*plan, x, w, b, eps, nullptr, nullptr);
  const Beside beside = accumulate_beside(x.device(), x.numel() / x.size(-1), {&w, &b});
  return LayerNormFn::apply(x, w, b, eps, act, &*plan, &beside);
}

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

// How many of a plan's launches go out as dependent launches (PDL), from its first: all by default; OPS_PDL=0
// none, OPS_PDL=1 only from the second (a benchmark's A/B, read once per process; docs/direct_launch.md).
int pdl_from() {
  static const int from = [] {
    const char* v = std::getenv("OPS_PDL");
    if (v == nullptr) return 0;
    const std::string s(v);
    return s == "0" ? 1 << 30 : s == "1" ? 1 : 0;
  }();
  return from;
}

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
  if (!takes(x, lnw, lnb, eps) || !linear_takes(x, w, bias)) return std::nullopt;
  return find(fused_plans, fused_key(x, lnw, lnb, w, algo));
}

// ops/layernorm_linear/'s layernorm_linear_fwd (y, mean, rstd) where ``algo`` resolves to "fused" or "sm90"
// and Python handed over the plan; none for a call Python takes.
std::vector<Tensor> layernorm_linear_with_stats(const Tensor& x_in, const Tensor& lnw, const Tensor& lnb,
                                                const Tensor& w, const std::optional<Tensor>& bias, double eps,
                                                int64_t algo) {
  const Tensor x = dense(x_in, lnw, lnb, eps);
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
  if (!takes(x_in, lnw, lnb, eps, true) || !linear_takes(x_in, w, bias)) return Tensor();
  const bool grad = grad_to_come({&x_in, &lnw, &lnb, &w}) || (bias.has_value() && grad_to_come({&*bias}));
  const bool captured = capturing(x_in.device());
  const int64_t variant = int64_t(grad) | int64_t(captured) << 1;   // set_linear_algo's
  auto unfused = find(linear_unfused, lnl_key(x_in, w, algo, variant));
  // No choice made for this variant yet (the Python route makes it), or the fused and Hopper forwards with a
  // gradient to come (Python's autograd).
  if (!unfused || (!*unfused && grad)) return Tensor();
  const Tensor x = dense(x_in, lnw, lnb, eps);
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
  auto out = ln_fwd_stats(dense(x, w, b, eps), w, b, eps, act);
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
  if (!takes(x, w, b, 1.0)) return ln_bwd_python(dy, x, w, b, mean, rstd, act);
  return ln_bwd(dy, x, w, b, mean, rstd, act);
}

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

void set_transpose_kernel(at::ScalarType dtype, int64_t device, int64_t kernel) {
  std::lock_guard<std::mutex> guard(plans_lock);
  transpose_kernels[Key{static_cast<int64_t>(dtype), device, 0, 0, 0, 0, 0, 0}] = function(kernel);
}

void clear_plans() {
  std::lock_guard<std::mutex> guard(plans_lock);
  transpose_kernels.clear();
  fused_plans.clear();
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

// How many shapes run on cuBLASLt (tests).
int64_t gemm_plan_count() {
  std::lock_guard<std::mutex> guard(gemm_lock);
  int64_t count = 0;
  for (const auto& entry : gemm_plans) count += entry.second != nullptr;
  return count;
}

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

// act(Linear(LayerNorm(x))) for torch.compile's training graphs (ops/layernorm_linear/'s _traced, where
// COMPILED_TRAINING_LAYERNORM_LINEAR is "ours"; act 1, GELU's tanh form, from ops/layernorm_linear/inductor.py's
// pass), so that the compiled code calls one op each way. The forward (y, xn, mean, rstd, h): our LayerNorm on CUDA
// (elsewhere torch's layer_norm in float32, float64 kept), then linear's GEMM, with act 1 GELU in its epilogue and
// h its input (else h is empty). mean and rstd are float32 (float64 for float64 x), shaped x's rows.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_linear_train_fwd(
    const Tensor& x, const Tensor& lnw, const Tensor& lnb, const Tensor& w, const std::optional<Tensor>& bias,
    double eps, int64_t act) {
  TORCH_CHECK(act == 0 || act == 1, "mojo_direct: layernorm_linear_train_fwd: act is 0 or 1, got ", act);
  const auto stat_shape = x.sizes().slice(0, x.dim() - 1);
  Tensor xn, mean, rstd;
  if (x.is_cuda()) {
    std::tie(xn, mean, rstd) = layernorm_fwd(dense(x, lnw, lnb, eps), lnw, lnb, eps, 0);
  } else {
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    auto [z, m, r] = at::native_layer_norm(x.to(acc), {x.size(-1)}, lnw.to(acc), lnb.to(acc), eps);
    std::tie(xn, mean, rstd) = std::make_tuple(z.to(x.scalar_type()), m, r);
  }
  auto [y, h] = linear_act(xn, w, bias, act == 1 ? ACT_GELU_AUX : ACT_NONE);
  return {y, xn, mean.reshape(stat_shape), rstd.reshape(stat_shape), act == 1 ? h : x.new_empty({0})};
}

// Its backward from dy and what the forward saved: [dx, dln_weight, dln_bias, dweight] and, with bias_grad, dbias
// (dweight empty, [0], and no dW GEMM without weight_grad). The Linear's part as linear_grads_op (act 0) or
// linear_gelu_grads_op (act 1) computes it, then our LayerNorm backward on CUDA (torch's elsewhere).
std::vector<Tensor> layernorm_linear_grads_op(const Tensor& dy, const Tensor& x, const Tensor& xn, const Tensor& lnw,
                                              const Tensor& lnb, const Tensor& w, const Tensor& mean,
                                              const Tensor& rstd, const Tensor& h, int64_t act, bool bias_grad,
                                              bool weight_grad) {
  const std::vector<Tensor> linear = act == 1 ? linear_gelu_grads_op(dy, xn, w, h, bias_grad, weight_grad)
                                              : linear_grads_op(dy, xn, w, bias_grad, weight_grad);
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

}  // namespace

TORCH_LIBRARY(mojo_direct, m) {
  m.def("layernorm(Tensor x, Tensor weight, Tensor bias, float eps, int act) -> Tensor");
  m.def("layernorm_linear(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, float eps, "
        "int algo) -> Tensor");
  m.def("layernorm_fwd(Tensor x, Tensor weight, Tensor bias, float eps, int act) -> (Tensor, Tensor, Tensor)");
  m.def("layernorm_with_stats(Tensor x, Tensor weight, Tensor bias, float eps, int act) -> Tensor[]");
  m.def("layernorm_bwd_with_plan(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, "
        "int act) -> Tensor[]");
  m.def("layernorm_linear_with_stats(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, "
        "float eps, int algo) -> Tensor[]");
  m.def("layernorm_infer(Tensor x, Tensor weight, Tensor bias, float eps, int act) -> Tensor");
  m.def("layernorm_linear_infer(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, "
        "float eps, int algo) -> Tensor");
  m.def("layernorm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, int act) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("set_fwd_plan(int rows, int h, ScalarType dtype, bool vec_ok, int act, int device, int kernel, int[] grid, "
        "int block, int cluster) -> ()", &set_fwd_plan);
  m.def("set_bwd_plan(int rows, int h, ScalarType dtype, bool vec_ok, int act, int device, int kernel, int[] grid, "
        "int block, int parts, int part_rows, int reduce_kernel, int[] reduce_grid, int reduce_block) -> ()",
        &set_bwd_plan);
  m.def("set_linear_algo(int rows, int k, int n, ScalarType dtype, int device, int algo, bool grad, bool captured, "
        "bool unfused) -> ()", &set_linear_algo);
  m.def("set_fused_plan(int rows, int k, int n, ScalarType dtype, int device, int algo, int mask, int kind, "
        "int[] kernels, int[] grids, int[] blocks, int[] smem, int[] sizes, "
        "Tensor? counters, Tensor zero_bias) -> ()", &set_fused_plan);
  m.def("set_transpose_kernel(ScalarType dtype, int device, int kernel) -> ()", &set_transpose_kernel);
  m.def("clear_plans() -> ()", &clear_plans);
  m.def("plan_counts() -> int[]", &plan_counts);
  m.def("set_poison(bool on) -> ()", &set_poison);
  m.def("gemm_plan_count() -> int", &gemm_plan_count);
  m.def("set_gemm_tuning(int no_workspace_k_per_n) -> ()", &set_gemm_tuning);
  m.def("set_capture_overlap(bool on) -> ()", &set_capture_overlap);
  m.def("set_accumulate_beside(int max_rows) -> ()", &set_accumulate_beside);
  m.def("linear(Tensor xn, Tensor weight, Tensor? bias) -> Tensor");
  // linear's kernel under its own name, for torch.compile's training graphs: its autograd kernel (TracedLinearFn,
  // whose backward is linear_grads) is one that eager calls of linear (no gradient to come) do not pass through.
  m.def("traced_linear(Tensor xn, Tensor weight, Tensor? bias) -> Tensor");
  // The backwards' ops: dweight is empty ([0]) where weight_grad is false (a frozen weight: no dW GEMM).
  m.def("linear_grads(Tensor dy, Tensor xn, Tensor weight, bool bias_grad, bool weight_grad=True) -> Tensor[]");
  m.def("linear_gelu(Tensor xn, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_gelu_aux(Tensor xn, Tensor weight, Tensor? bias) -> (Tensor, Tensor)");
  m.def("linear_gelu_grads(Tensor dy, Tensor xn, Tensor weight, Tensor h, bool bias_grad, bool weight_grad=True) "
        "-> Tensor[]");
  m.def("traced_linear_gelu(Tensor xn, Tensor weight, Tensor? bias, bool bias_grad_in_gemm=True) -> Tensor");
  m.def("layernorm_linear_train_fwd(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, "
        "float eps, int act) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("layernorm_linear_grads(Tensor dy, Tensor x, Tensor xn, Tensor ln_weight, Tensor ln_bias, Tensor weight, "
        "Tensor mean, Tensor rstd, Tensor h, int act, bool bias_grad, bool weight_grad=True) -> Tensor[]");
  m.def("traced_layernorm_linear(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, "
        "float eps, int act=0) -> Tensor");
}

// The autograd kernels are the entries; under inference mode (no autograd keys) the same functions run as
// the backend kernels, with no grad to come.
static void impl_entries(torch::Library& m) {
  m.impl("layernorm", &layernorm);
  m.impl("layernorm_linear", &layernorm_linear);
}

TORCH_LIBRARY_IMPL(mojo_direct, Autograd, m) {
  impl_entries(m);
  m.impl("traced_linear", &traced_linear);
  m.impl("traced_linear_gelu", &traced_linear_gelu);
  m.impl("traced_layernorm_linear", &traced_layernorm_linear);
}

TORCH_LIBRARY_IMPL(mojo_direct, CompositeExplicitAutograd, m) {
  impl_entries(m);
  m.impl("layernorm_with_stats", &layernorm_with_stats);
  m.impl("layernorm_bwd_with_plan", &layernorm_bwd_with_plan);
  m.impl("layernorm_linear_with_stats", &layernorm_linear_with_stats);
  m.impl("linear", &linear_forward);
  m.impl("traced_linear", &linear_forward);
  m.impl("linear_gelu", &linear_gelu);
  m.impl("linear_gelu_aux", &linear_gelu_aux);
  m.impl("linear_gelu_grads", &linear_gelu_grads_op);
  m.impl("traced_linear_gelu", &traced_linear_gelu_forward);
  m.impl("linear_grads", &linear_grads_op);
  m.impl("layernorm_linear_train_fwd", &layernorm_linear_train_fwd);
  m.impl("layernorm_linear_grads", &layernorm_linear_grads_op);
  m.impl("traced_layernorm_linear", &traced_layernorm_linear_forward);
}

TORCH_LIBRARY_IMPL(mojo_direct, CUDA, m) {
  m.impl("layernorm_fwd", &layernorm_fwd);
  m.impl("layernorm_infer", &layernorm_infer);
  m.impl("layernorm_linear_infer", &layernorm_linear_infer);
  m.impl("layernorm_bwd", &layernorm_bwd);
}
