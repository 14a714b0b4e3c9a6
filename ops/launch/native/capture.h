// Under CUDA graph capture: the weights' gradients and their accumulation on streams beside the chain; the
// transposing copy of a column-major x.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

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
  auto plan = find(transpose_plans, Key{static_cast<int64_t>(x.scalar_type()), x.get_device(), 0, 0, 0, 0, 0, 0});
  if (!plan) return std::nullopt;
  const int64_t tile = plan->tile;
  const int64_t tiles_r = (r + tile - 1) / tile;
  if (x.numel() > INT32_LIMIT || batch_stride > INT32_LIMIT || batch_stride * (batches - 1) + r * h > INT32_LIMIT ||
      tiles_r > GRID_YZ_LIMIT || batches > GRID_YZ_LIMIT)
    return std::nullopt;
  Tensor y = empty(x.sizes(), x.options());
  void* yp = y.data_ptr();
  void* xp = x.data_ptr();
  int32_t r32 = static_cast<int32_t>(r), h32 = static_cast<int32_t>(h), stride32 = static_cast<int32_t>(batch_stride);
  void* params[] = {&yp, &xp, &r32, &h32, &stride32};
  const std::array<unsigned, 3> grid = {static_cast<unsigned>((h + tile - 1) / tile), static_cast<unsigned>(tiles_r),
                                        static_cast<unsigned>(batches)};
  c10::DeviceGuard guard(x.device());
  launch(x.device(), plan->kernel, grid, static_cast<unsigned>(plan->threads), 1, params, 0);
  return y;
}

// x as the kernels take it: a strided x of a call the C++ route takes otherwise is copied once (copy_transposed,
// or torch's contiguous(); with autograd, the copy's backward puts the gradient back in place, as Python's
// layernorm.adapt does); any other x as it is.
Tensor dense(const Tensor& x, const Tensor& w, const Tensor& b) {
  if (!plain({&x}) || x.is_contiguous() || !takes(x, w, b, true)) return x;   // a sparse x: no is_contiguous
  if (auto y = copy_transposed(x)) return *y;
  return x.contiguous();
}
