// The unfused route's Linear and its gradients on cuBLASLt (found with dlsym), with their GEMM plans.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

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
    if (lib == nullptr) return;
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

// Whether the Linear's GEMMs run on cuBLASLt (else torch's ops): set_cublaslt, a benchmark's A/B.
std::atomic<bool> cublaslt_on{true};

void set_cublaslt(bool on) { cublaslt_on = on; }

const CublasLt* cublas_lt() {
  static const CublasLt lt;
  return lt.ok() && cublaslt_on.load() ? &lt : nullptr;
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

// Every GEMM's workspace cap in bytes, where a benchmark's A/B sets one (set_lt_workspace, before the first GEMM
// plan: plans keep their algorithm); -1: the rule below.
std::atomic<int64_t> lt_forced_workspace{-1};

void set_lt_workspace(int64_t bytes) { lt_forced_workspace = bytes; }

// The most workspace the algorithm of a GEMM of `kind` may ask for: none for a forward in the rule above, else
// LT_MAX_WORKSPACE (or what set_lt_workspace forces).
uint64_t lt_max_workspace(int64_t kind, int64_t n, int64_t k) {
  if (const int64_t forced = lt_forced_workspace.load(); forced >= 0) return static_cast<uint64_t>(forced);
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
