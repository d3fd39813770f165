// Device discovery. The runtime is linked statically, so this module loads on hosts without a
// CUDA runtime; without a driver (libcuda) cudaGetDeviceCount fails and the answer is 0.
#include <string>

#include "common.cuh"

namespace tiercache {
namespace cuda {

bool compiled() { return true; }

namespace {

// {count, error}: count is 0 whenever error is not cudaSuccess.
std::pair<int, cudaError_t> probe() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls report their own
    return {0, err};
  }
  return {count, cudaSuccess};
}

}  // namespace

int device_count() { return probe().first; }

std::string status() {
  auto [count, err] = probe();
  if (err != cudaSuccess)
    return std::string("no usable CUDA device: ") + cudaGetErrorName(err) + " (" +
           cudaGetErrorString(err) + ")";
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  return std::to_string(count) + " CUDA device(s), runtime " + std::to_string(runtime) +
         ", driver " + std::to_string(driver);
}

namespace detail {

void require_device(int device) {
  int count = device_count();
  if (count == 0) throw CudaUnavailableError(status());
  if (device < 0 || device >= count)
    throw CudaUnavailableError("CUDA device " + std::to_string(device) + " does not exist (" +
                               std::to_string(count) + " device(s))");
}

}  // namespace detail
}  // namespace cuda
}  // namespace tiercache
