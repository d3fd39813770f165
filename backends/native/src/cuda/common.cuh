// Helpers shared by the CUDA sources (not installed).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "tiercache/cuda.h"

namespace tiercache {
namespace cuda {
namespace detail {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  throw CudaError(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                  cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Throws CudaUnavailableError unless `device` is a usable device index.
void require_device(int device);

// Sets the current device for the lifetime of the guard, then restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

constexpr int kThreads = 256;

inline unsigned int blocks_for(unsigned long long work, unsigned int max_blocks = 1024) {
  unsigned long long blocks = (work + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned int>(blocks < max_blocks ? blocks : max_blocks);
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
