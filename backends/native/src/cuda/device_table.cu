// Publication of rows into one card's memory, with a count the host reads from mapped memory.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common.cuh"
#include "tiercache/shared_table.h"
#include "tiercache/check_rows.h"

namespace tiercache {
namespace cuda {

using detail::DeviceGuard;

namespace {

// Copies n rows into the table (and the host mirror), then publishes first + n.
//
// Ordering: every thread fences its own row stores with __threadfence_system() before the
// block's barrier; thread 0 then counts the block as done. The block that finishes last has
// observed every other block's count, fences once more, and only then stores the new count:
// into device memory for kernels that follow, and into the host-mapped flag for host readers.
// A host that loads the flag with acquire ordering sees every row below it.
__global__ void publish_rows_kernel(const float* __restrict__ src, float* rows, float* mirror,
                                    std::uint64_t first, std::uint64_t n, std::uint32_t width,
                                    unsigned int* blocks_done, std::uint64_t* device_count,
                                    std::uint64_t* host_flag) {
  const std::uint64_t total = n * width;
  const std::uint64_t offset = first * width;
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const float v = src[i];
    rows[offset + i] = v;
    if (mirror != nullptr) mirror[offset + i] = v;
  }
  __threadfence_system();
  __syncthreads();

  __shared__ bool last_block;
  if (threadIdx.x == 0) last_block = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last_block && threadIdx.x == 0) {
    *blocks_done = 0;  // for the next launch, which runs after this one on the same stream
    __threadfence_system();
    *reinterpret_cast<volatile std::uint64_t*>(device_count) = first + n;
    __threadfence_system();
    *reinterpret_cast<volatile std::uint64_t*>(host_flag) = first + n;
  }
}

}  // namespace

struct DeviceTable::Impl {
  int device = 0;
  std::uint32_t width = 0;
  std::uint64_t capacity = 0;
  float* rows = nullptr;            // device
  std::uint64_t* count = nullptr;   // device
  unsigned int* blocks_done = nullptr;
  std::uint64_t* flag = nullptr;    // pinned, mapped
  std::uint64_t* flag_dev = nullptr;
  float* mirror = nullptr;          // pinned, mapped (optional)
  float* mirror_dev = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t caller_ready = nullptr;  // recorded on the caller's stream before a device publish
  cudaEvent_t source_read = nullptr;   // recorded on `stream` after that publish's kernel
  bool pools = false;               // stream-ordered allocation supported
  std::uint64_t next = 0;           // rows whose publication kernel has been queued
  mutable std::mutex writer;

  void launch(const float* src, std::uint64_t first, std::uint64_t n) {
    TIERCACHE_CUDA(detail::launch_kernel(publish_rows_kernel, detail::blocks_for(n * width),
                                         detail::kThreads, stream, src, rows, mirror_dev, first,
                                         n, width, blocks_done, count, flag_dev));
  }

  // Checks that n more rows fit; the caller advances `next` only once their kernel is queued,
  // so a publish that fails before that leaves no hole for a later publish to count.
  void check_room(std::uint64_t n) const {
    if (n > capacity - next)
      throw TableFullError("device table full: " + std::to_string(next) + " of " +
                              std::to_string(capacity) + " rows used, " + std::to_string(n) +
                              " more do not fit");
  }

  void release() noexcept {
    DeviceGuard guard(device, std::nothrow);
    if (stream != nullptr) cudaStreamSynchronize(stream);
    cudaFree(rows);
    cudaFree(count);
    cudaFree(blocks_done);
    if (flag != nullptr) cudaFreeHost(flag);
    if (mirror != nullptr) cudaFreeHost(mirror);
    if (caller_ready != nullptr) cudaEventDestroy(caller_ready);
    if (source_read != nullptr) cudaEventDestroy(source_read);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

namespace {

// The scratch copy of one host publish. Freed in stream order after the kernel that reads it
// (pools), else after a wait for the stream; on error paths as well.
class Scratch {
 public:
  explicit Scratch(DeviceTable::Impl& table) : table_(table) {}
  ~Scratch() {
    if (data_ == nullptr) return;
    if (table_.pools) {
      cudaFreeAsync(data_, table_.stream);
    } else {
      cudaStreamSynchronize(table_.stream);
      cudaFree(data_);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  float* allocate(std::size_t bytes) {
    if (table_.pools)
      TIERCACHE_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&data_), bytes, table_.stream));
    else
      TIERCACHE_CUDA(cudaMalloc(&data_, bytes));
    return data_;
  }

 private:
  DeviceTable::Impl& table_;
  float* data_ = nullptr;
};

}  // namespace

DeviceTable::DeviceTable(int device, std::uint32_t width, std::uint64_t capacity,
                         bool host_mirror)
    : impl_(new Impl) {
  detail::require_device(device);
  if (width == 0 || capacity == 0) throw std::invalid_argument("width and capacity must be > 0");
  // The byte size must not wrap (a wrapped size would allocate a few bytes that publishes then
  // overrun): at most 4 TiB of rows, the host table's bound.
  if (capacity > (std::uint64_t{1} << 42) / (std::uint64_t{width} * sizeof(float)))
    throw std::invalid_argument("capacity must leave the rows at most 4 TiB");
  Impl& d = *impl_;
  d.device = device;
  d.width = width;
  d.capacity = capacity;
  DeviceGuard guard(device);
  try {
    const std::size_t bytes = capacity * width * sizeof(float);
    TIERCACHE_CUDA(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
    TIERCACHE_CUDA(cudaEventCreateWithFlags(&d.caller_ready, cudaEventDisableTiming));
    TIERCACHE_CUDA(cudaEventCreateWithFlags(&d.source_read, cudaEventDisableTiming));
    TIERCACHE_CUDA(cudaMalloc(&d.rows, bytes));
    TIERCACHE_CUDA(cudaMemset(d.rows, 0, bytes));
    TIERCACHE_CUDA(cudaMalloc(&d.count, sizeof(std::uint64_t)));
    TIERCACHE_CUDA(cudaMemset(d.count, 0, sizeof(std::uint64_t)));
    TIERCACHE_CUDA(cudaMalloc(&d.blocks_done, sizeof(unsigned int)));
    TIERCACHE_CUDA(cudaMemset(d.blocks_done, 0, sizeof(unsigned int)));
    TIERCACHE_CUDA(cudaHostAlloc(&d.flag, sizeof(std::uint64_t),
                                 cudaHostAllocMapped | cudaHostAllocPortable));
    *d.flag = 0;
    TIERCACHE_CUDA(cudaHostGetDevicePointer(&d.flag_dev, d.flag, 0));
    if (host_mirror) {
      TIERCACHE_CUDA(cudaHostAlloc(&d.mirror, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
      std::memset(d.mirror, 0, bytes);
      TIERCACHE_CUDA(cudaHostGetDevicePointer(&d.mirror_dev, d.mirror, 0));
    }
    int pools = 0;
    TIERCACHE_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    d.pools = pools != 0;
    TIERCACHE_CUDA(cudaDeviceSynchronize());
  } catch (...) {
    d.release();
    throw;
  }
}

DeviceTable::~DeviceTable() {
  if (impl_) impl_->release();
}

std::uint64_t DeviceTable::publish_host(const float* rows, std::uint64_t n) {
  Impl& d = *impl_;
  std::lock_guard<std::mutex> lock(d.writer);
  d.check_room(n);
  const std::uint64_t first = d.next;
  if (n == 0) return first;
  DeviceGuard guard(d.device);
  Scratch src(d);
  const std::size_t bytes = n * d.width * sizeof(float);
  float* scratch = src.allocate(bytes);
  TIERCACHE_CUDA(cudaMemcpyAsync(scratch, rows, bytes, cudaMemcpyHostToDevice, d.stream));
  // cudaMemcpyAsync may return before it has read `rows` (always for pinned memory, and for
  // pageable memory where the driver chooses to), and `rows` may be the caller's buffer or
  // nanobind's temporary, both reused as soon as this returns: wait until the copy is done.
  // (The wait also covers earlier publishes still queued on the stream.)
  TIERCACHE_CUDA(cudaStreamSynchronize(d.stream));
  d.launch(scratch, first, n);
  d.next = first + n;  // queued: the kernel publishes first + n
  return first;
}

std::uint64_t DeviceTable::publish_device(const float* device_rows, std::uint64_t n,
                                          std::uint64_t caller_stream) {
  Impl& d = *impl_;
  std::lock_guard<std::mutex> lock(d.writer);
  d.check_room(n);
  const std::uint64_t first = d.next;
  if (n == 0) return first;
  DeviceGuard guard(d.device);
  auto caller = reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(caller_stream));
  // The rows were written by work on the caller's stream; the table's stream is non-blocking,
  // so nothing orders it after that work unless it waits for it.
  TIERCACHE_CUDA(cudaEventRecord(d.caller_ready, caller));
  TIERCACHE_CUDA(cudaStreamWaitEvent(d.stream, d.caller_ready, 0));
  d.launch(device_rows, first, n);
  d.next = first + n;
  // And later work on the caller's stream waits for the kernel to have read the rows, so a
  // stream-ordered allocator can reuse their memory on that stream.
  TIERCACHE_CUDA(cudaEventRecord(d.source_read, d.stream));
  TIERCACHE_CUDA(cudaStreamWaitEvent(caller, d.source_read, 0));
  return first;
}

std::uint64_t DeviceTable::count() const {
  std::lock_guard<std::mutex> lock(impl_->writer);
  return impl_->next;
}

std::uint64_t DeviceTable::host_count() const {
  return __atomic_load_n(impl_->flag, __ATOMIC_ACQUIRE);
}

const float* DeviceTable::host_mirror() const { return impl_->mirror; }

std::uint64_t DeviceTable::device_count() {
  Impl& d = *impl_;
  DeviceGuard guard(d.device);
  std::uint64_t value = 0;
  TIERCACHE_CUDA(cudaMemcpyAsync(&value, d.count, sizeof(value), cudaMemcpyDeviceToHost, d.stream));
  TIERCACHE_CUDA(cudaStreamSynchronize(d.stream));
  return value;
}

void DeviceTable::copy_rows(float* out, std::uint64_t first, std::uint64_t n) {
  Impl& d = *impl_;
  if (first > d.capacity || n > d.capacity - first)
    throw std::out_of_range("rows outside the table");
  DeviceGuard guard(d.device);
  TIERCACHE_CUDA(cudaMemcpyAsync(out, d.rows + first * d.width, n * d.width * sizeof(float),
                                 cudaMemcpyDeviceToHost, d.stream));
  TIERCACHE_CUDA(cudaStreamSynchronize(d.stream));
}

void DeviceTable::synchronize() {
  DeviceGuard guard(impl_->device);
  TIERCACHE_CUDA(cudaStreamSynchronize(impl_->stream));
}

std::vector<std::uint64_t> DeviceTable::watch_mirror(std::uint64_t until, double timeout_s) const {
  const Impl& d = *impl_;
  if (d.mirror == nullptr) throw std::logic_error("this table has no host mirror");
  if (d.width < 2) throw std::logic_error("check rows need a width of at least 2");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::uint64_t polls = 0, distinct = 0, bad = 0, checked = 0, last = 0;
  while (true) {
    ++polls;
    const std::uint64_t seen = __atomic_load_n(d.flag, __ATOMIC_ACQUIRE);
    if (seen != last) {
      ++distinct;
      last = seen;
    }
    for (; checked < seen && checked < d.capacity; ++checked)
      if (!check::row_ok(d.mirror + checked * d.width, d.width, checked)) ++bad;
    if (seen >= until || std::chrono::steady_clock::now() > deadline) break;
  }
  return {polls, distinct, bad, last};
}

int DeviceTable::device() const { return impl_->device; }
std::uint32_t DeviceTable::width() const { return impl_->width; }
std::uint64_t DeviceTable::capacity() const { return impl_->capacity; }
std::uint64_t DeviceTable::stream_handle() const {
  return reinterpret_cast<std::uint64_t>(impl_->stream);
}
std::uint64_t DeviceTable::rows_pointer() const {
  return reinterpret_cast<std::uint64_t>(impl_->rows);
}

}  // namespace cuda
}  // namespace tiercache
