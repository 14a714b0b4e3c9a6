// The direct launcher's host side in C++ (ops/launch/direct.py builds and loads it): LayerNorm (+GELU), RMSNorm and
// the unfused LayerNorm+Linear as torch operators with C++ autograd, and the fused and Hopper LayerNorm+Linear
// forwards (no gradient), so that an eager call costs what a torch op costs (allocation, launch and the
// backward's autograd node in C++, no Python per call).
//
// It decides nothing: Python (ops/layernorm/config.py, ops/layernorm_linear/config.py) chooses every launch and
// hands each choice to the plan tables below (set_fwd_plan, set_bwd_plan, set_linear_algo, set_fused_plan) the
// first time it sees a shape. A strided x is copied once (dense). An op returns an undefined tensor (None in
// Python) for any call it does not take: no plan yet, or inputs that Python's classifier would not send to the kernels
// as they come (accepts, in native/plans.h, mirrors it; a strided x is taken and copied once).
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
#include <torch/csrc/autograd/forward_grad.h>
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

// The parts, by concern (ops/launch/native/): each is included here, in order, inside this namespace.
#include "native/driver.h"
#include "native/plans.h"
#include "native/cublaslt.h"
#include "native/capture.h"
#include "native/layernorm.h"
#include "native/rmsnorm.h"
#include "native/add_norm.h"
#include "native/layernorm_linear.h"
#include "native/compiled.h"
#include "native/registration.h"
#include "native/traced.h"

}  // namespace

TORCH_LIBRARY(mojo_direct, m) {
  m.def("layernorm(Tensor x, Tensor weight, Tensor bias, float eps, int act) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int act) -> Tensor");
  m.def("set_rms_codes(int norm, int llama, int gemma) -> ()", &set_rms_codes);
  m.def("rms_norm_linear(Tensor x, Tensor norm_weight, Tensor weight, Tensor? bias, float eps, int act) "
        "-> Tensor");
  m.def("add_norm(Tensor x, Tensor residual, Tensor? add_bias, Tensor weight, Tensor bias, float eps, int act) "
        "-> Tensor[]");
  m.def("set_add_norm_plan(int rows, int h, ScalarType dtype, int act, bool bias, int device, int kernel, "
        "int[] grid, int block) -> ()", &set_add_norm_plan);
  m.def("layernorm_linear(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, float eps, "
        "int algo) -> Tensor");
  m.def("layernorm_linear_act(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias, float eps, "
        "int act) -> Tensor");
  m.def("linears(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor[]");
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
  m.def("set_transpose_kernel(ScalarType dtype, int device, int kernel, int tile, int threads) -> ()",
        &set_transpose_kernel);
  m.def("layernorm_accepts(Tensor x, Tensor weight, Tensor bias) -> bool", &layernorm_accepts);
  m.def("layernorm_linear_accepts(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor weight, Tensor? bias) -> bool",
        &layernorm_linear_accepts);
  m.def("clear_plans() -> ()", &clear_plans);
  m.def("plan_counts() -> int[]", &plan_counts);
  m.def("set_poison(bool on) -> ()", &set_poison);
  m.def("gemm_plan_count() -> int", &gemm_plan_count);
  m.def("set_gemm_tuning(int no_workspace_k_per_n) -> ()", &set_gemm_tuning);
  m.def("set_cublaslt(bool on) -> ()", &set_cublaslt);            // benchmarks' A/Bs (docs/direct_launch.md)
  m.def("set_lt_workspace(int bytes) -> ()", &set_lt_workspace);
  m.def("set_pdl_from(int first) -> ()", &set_pdl_from);
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
  m.def("traced_linears(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor[]");
}

// The autograd kernels are the entries; under inference mode (no autograd keys) the same functions run as
// the backend kernels, with no grad to come.
static void impl_entries(torch::Library& m) {
  m.impl("layernorm", &layernorm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_linear", &rms_norm_linear);
  m.impl("add_norm", &add_norm);
  m.impl("layernorm_linear", &layernorm_linear);
  m.impl("layernorm_linear_act", &layernorm_linear_act);
  m.impl("linears", &linears);
}

TORCH_LIBRARY_IMPL(mojo_direct, Autograd, m) {
  impl_entries(m);
  m.impl("traced_linear", &traced_linear);
  m.impl("traced_linear_gelu", &traced_linear_gelu);
  m.impl("traced_layernorm_linear", &traced_layernorm_linear);
  m.impl("traced_linears", &traced_linears);
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
  m.impl("traced_linears", &traced_linears_forward);
}

TORCH_LIBRARY_IMPL(mojo_direct, CUDA, m) {
  m.impl("layernorm_fwd", &layernorm_fwd);
  m.impl("layernorm_infer", &layernorm_infer);
  m.impl("layernorm_linear_infer", &layernorm_linear_infer);
  m.impl("layernorm_bwd", &layernorm_bwd);
}
