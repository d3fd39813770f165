// Helpers shared by the CUDA sources (not installed).
#pragma once

#include <cuda_runtime.h>

#include <new>
#include <string>
#include <utility>

#include "tiercache/cuda.h"

namespace tiercache {
namespace cuda {
namespace detail {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  throw CudaError(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                  cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace detail
}  // namespace cuda
}  // namespace tiercache

#define TIERCACHE_CUDA(call)                                                      \
  do {                                                                            \
    cudaError_t tiercache_err_ = (call);                                          \
    if (tiercache_err_ != cudaSuccess)                                            \
      ::tiercache::cuda::detail::throw_cuda(tiercache_err_, #call, __FILE__, __LINE__); \
  } while (0)

namespace tiercache {
namespace cuda {
namespace detail {

// Throws CudaUnavailableError unless `device` is a usable device index.
void require_device(int device);

// Makes `device` current for the lifetime of the guard, then restores the previous one.
//
// DeviceGuard(device) throws CudaError when the current device cannot be read or set: going on
// would allocate and launch on whatever card was current before. DeviceGuard(device,
// std::nothrow) is for teardown, which must not throw: ok() says whether `device` is current.
// The destructor never throws; a failure to restore the previous device is dropped.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TIERCACHE_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TIERCACHE_CUDA(cudaSetDevice(device));
      restore_ = true;
    }
    ok_ = true;
  }
  DeviceGuard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) return;
    if (previous_ != device) {
      if (cudaSetDevice(device) != cudaSuccess) return;
      restore_ = true;
    }
    ok_ = true;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  bool ok() const { return ok_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  bool ok_ = false;  // set once the device is current: a nothrow guard that failed says so
};

// Launches `kernel` and returns this launch's own error. A <<<>>> launch reports a bad
// configuration only through cudaGetLastError(), which returns (and clears) an earlier,
// unrelated error of this thread just as well, so a publish would fail for someone else's
// error. The arguments are converted to the kernel's parameter types, as by a <<<>>> launch.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), unsigned int blocks, unsigned int threads,
                          cudaStream_t stream, Args&&... args) {
  return [&](Params... params) {
    void* slots[] = {&params...};
    return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(threads),
                            slots, 0, stream);
  }(std::forward<Args>(args)...);
}

constexpr int kThreads = 256;

inline unsigned int blocks_for(unsigned long long work, unsigned int max_blocks = 1024) {
  unsigned long long blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned int>(blocks < max_blocks ? blocks : max_blocks);
}

}  // namespace detail
}  // namespace cuda
}  // namespace tiercache
