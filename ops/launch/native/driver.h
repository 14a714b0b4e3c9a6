// The CUDA driver API (found with dlsym: no CUDA headers), torch's streams and graph capture.
// Part of direct.cpp's one translation unit (included inside its anonymous namespace, in order).
#pragma once

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
