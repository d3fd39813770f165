// Replicas of one table on several cards, kept in step by broadcast.
#include <algorithm>
#include <atomic>
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

__global__ void store_count_kernel(std::uint64_t* count, std::uint64_t value) {
  *reinterpret_cast<volatile std::uint64_t*>(count) = value;
}

// What a reader on the reader stream does: read the count, then the rows below it.
// report: {checks, bad rows, largest count seen}.
__global__ void check_rows_kernel(const float* rows, const std::uint64_t* count,
                                  std::uint32_t width, unsigned long long* report) {
  __shared__ std::uint64_t n;
  if (threadIdx.x == 0) n = *reinterpret_cast<const volatile std::uint64_t*>(count);
  __syncthreads();
  unsigned long long bad = 0;
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x)
    if (!check::row_ok(rows + i * width, width, i)) ++bad;
  if (bad != 0) atomicAdd(&report[1], bad);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    atomicAdd(&report[0], 1ULL);
    atomicMax(&report[2], static_cast<unsigned long long>(n));
  }
}

enum class Path { kSource, kPeer, kSameCard, kStaging };

const char* path_name(Path p) {
  switch (p) {
    case Path::kSource: return "source";
    case Path::kPeer: return "peer";
    case Path::kSameCard: return "same-card";
    case Path::kStaging: return "staging";
  }
  return "?";
}

struct Replica {
  int device = 0;
  Path path = Path::kSource;
  float* rows = nullptr;
  std::uint64_t* count = nullptr;
  unsigned long long* report = nullptr;  // check_rows_kernel's counters
  cudaStream_t copy = nullptr;    // copies into this replica
  cudaStream_t reader = nullptr;  // where the count is published and readers run
  cudaEvent_t copied = nullptr;     // rows of the latest broadcast are in this replica
  cudaEvent_t published = nullptr;  // ... and so is its count
  cudaEvent_t drained = nullptr;    // the staging buffer's copy into this replica is done
};

}  // namespace

struct ReplicaSet::Impl {
  std::uint32_t width = 0;
  std::uint64_t capacity = 0;
  std::uint64_t staging_rows = 0;
  std::vector<Replica> replicas;
  float* staging = nullptr;                 // pinned host memory for the staging path
  cudaEvent_t staging_filled = nullptr;     // source -> staging copy done
  cudaEvent_t staging_drained = nullptr;    // the latest staging -> replica copy; then reusable
  std::atomic<std::uint64_t> count{0};  // stored under `writer`, read by count() without it
  std::mutex writer;
  std::string poisoned;  // under `writer`: why broadcasts are refused (empty: they are not)

  std::size_t row_bytes() const { return std::size_t{width} * sizeof(float); }

  void replicate(std::uint64_t first, std::uint64_t n) {
    Replica& src = replicas[0];
    {
      DeviceGuard guard(src.device);
      TIERCACHE_CUDA(cudaEventRecord(src.copied, src.copy));
    }
    const std::size_t offset = first * width;
    for (std::size_t k = 1; k < replicas.size(); ++k) {
      Replica& dst = replicas[k];
      if (dst.path == Path::kStaging) {
        stage(src, dst, first, n);
        continue;
      }
      DeviceGuard guard(dst.device);
      TIERCACHE_CUDA(cudaStreamWaitEvent(dst.copy, src.copied, 0));
      if (dst.path == Path::kPeer) {
        TIERCACHE_CUDA(cudaMemcpyPeerAsync(dst.rows + offset, dst.device, src.rows + offset,
                                           src.device, n * row_bytes(), dst.copy));
      } else {
        TIERCACHE_CUDA(cudaMemcpyAsync(dst.rows + offset, src.rows + offset, n * row_bytes(),
                                       cudaMemcpyDeviceToDevice, dst.copy));
      }
      TIERCACHE_CUDA(cudaEventRecord(dst.copied, dst.copy));
    }
    // Each card publishes the count on its reader stream only after its rows have landed.
    for (Replica& r : replicas) {
      DeviceGuard guard(r.device);
      TIERCACHE_CUDA(cudaStreamWaitEvent(r.reader, r.copied, 0));
      TIERCACHE_CUDA(
          detail::launch_kernel(store_count_kernel, 1, 1, r.reader, r.count, first + n));
      TIERCACHE_CUDA(cudaEventRecord(r.published, r.reader));
    }
    count.store(first + n, std::memory_order_release);
  }

  void check_usable() const {
    if (!poisoned.empty())
      throw CudaError("this ReplicaSet refuses broadcasts: an earlier one failed partway and may "
                      "have published its rows on some replicas only (" + poisoned +
                      "); make a new ReplicaSet");
  }

  // Replicates, and poisons the set if that fails partway: some replicas may already show
  // count first + n while count() stays at first, and a later broadcast would write rows
  // [first, ...) again under readers that saw them published.
  void replicate_or_poison(std::uint64_t first, std::uint64_t n) {
    try {
      replicate(first, n);
    } catch (const std::exception& e) {
      poisoned = e.what();
      throw;
    }
  }

  // Source card -> pinned host buffer -> destination card, one staging buffer's worth at a
  // time. The host waits only when it is about to refill the buffer.
  void stage(Replica& src, Replica& dst, std::uint64_t first, std::uint64_t n) {
    for (std::uint64_t done = 0; done < n;) {
      const std::uint64_t rows = std::min(staging_rows, n - done);
      const std::size_t offset = (first + done) * width;
      const std::size_t bytes = rows * row_bytes();
      {
        DeviceGuard guard(src.device);
        if (staging_drained != nullptr) TIERCACHE_CUDA(cudaEventSynchronize(staging_drained));
        TIERCACHE_CUDA(cudaMemcpyAsync(staging, src.rows + offset, bytes, cudaMemcpyDeviceToHost,
                                       src.copy));
        TIERCACHE_CUDA(cudaEventRecord(staging_filled, src.copy));
      }
      {
        DeviceGuard guard(dst.device);
        TIERCACHE_CUDA(cudaStreamWaitEvent(dst.copy, staging_filled, 0));
        TIERCACHE_CUDA(cudaMemcpyAsync(dst.rows + offset, staging, bytes, cudaMemcpyHostToDevice,
                                       dst.copy));
        TIERCACHE_CUDA(cudaEventRecord(dst.drained, dst.copy));  // events belong to a card
        staging_drained = dst.drained;
      }
      done += rows;
    }
    DeviceGuard guard(dst.device);
    TIERCACHE_CUDA(cudaEventRecord(dst.copied, dst.copy));
  }

  void check_range(std::size_t replica, std::uint64_t first, std::uint64_t n) const {
    if (replica >= replicas.size()) throw std::out_of_range("no such replica");
    if (first > capacity || n > capacity - first) throw std::out_of_range("rows outside the table");
  }

  // Waits for every replica's streams before freeing anything: a replica's copy stream reads
  // the source's rows (and the staging buffer), and for a replica on another card that work is
  // not covered by cudaFree's implicit synchronization of the source's card.
  void release() noexcept {
    for (Replica& r : replicas) {
      DeviceGuard guard(r.device, std::nothrow);
      if (r.copy != nullptr) cudaStreamSynchronize(r.copy);
      if (r.reader != nullptr) cudaStreamSynchronize(r.reader);
    }
    for (Replica& r : replicas) {
      DeviceGuard guard(r.device, std::nothrow);
      cudaFree(r.rows);
      cudaFree(r.count);
      cudaFree(r.report);
      if (r.copied != nullptr) cudaEventDestroy(r.copied);
      if (r.published != nullptr) cudaEventDestroy(r.published);
      if (r.drained != nullptr) cudaEventDestroy(r.drained);
      if (r.copy != nullptr) cudaStreamDestroy(r.copy);
      if (r.reader != nullptr) cudaStreamDestroy(r.reader);
    }
    if (replicas.empty()) return;
    DeviceGuard guard(replicas[0].device, std::nothrow);
    if (staging_filled != nullptr) cudaEventDestroy(staging_filled);
    if (staging != nullptr) cudaFreeHost(staging);
  }
};

ReplicaSet::ReplicaSet(std::vector<int> devices, std::uint32_t width, std::uint64_t capacity,
                       bool allow_peer, std::uint64_t staging_rows)
    : impl_(new Impl) {
  for (int device : devices) detail::require_device(device);
  if (devices.empty()) throw std::invalid_argument("at least one device");
  if (width == 0 || capacity == 0) throw std::invalid_argument("width and capacity must be > 0");
  // The byte size must not wrap (see DeviceTable): at most 4 TiB of rows.
  if (capacity > (std::uint64_t{1} << 42) / (std::uint64_t{width} * sizeof(float)))
    throw std::invalid_argument("capacity must leave the rows at most 4 TiB");
  Impl& s = *impl_;
  s.width = width;
  s.capacity = capacity;
  s.staging_rows = std::max<std::uint64_t>(1, std::min(staging_rows, capacity));
  const std::size_t bytes = capacity * s.row_bytes();
  s.replicas.reserve(devices.size());
  try {
    for (std::size_t k = 0; k < devices.size(); ++k) {
      Replica r;
      r.device = devices[k];
      s.replicas.push_back(r);
      Replica& rep = s.replicas.back();
      DeviceGuard guard(rep.device);
      TIERCACHE_CUDA(cudaStreamCreateWithFlags(&rep.copy, cudaStreamNonBlocking));
      TIERCACHE_CUDA(cudaStreamCreateWithFlags(&rep.reader, cudaStreamNonBlocking));
      TIERCACHE_CUDA(cudaEventCreateWithFlags(&rep.copied, cudaEventDisableTiming));
      TIERCACHE_CUDA(cudaEventCreateWithFlags(&rep.published, cudaEventDisableTiming));
      TIERCACHE_CUDA(cudaEventCreateWithFlags(&rep.drained, cudaEventDisableTiming));
      TIERCACHE_CUDA(cudaMalloc(&rep.rows, bytes));
      TIERCACHE_CUDA(cudaMemset(rep.rows, 0, bytes));
      TIERCACHE_CUDA(cudaMalloc(&rep.count, sizeof(std::uint64_t)));
      TIERCACHE_CUDA(cudaMemset(rep.count, 0, sizeof(std::uint64_t)));
      TIERCACHE_CUDA(cudaMalloc(&rep.report, 3 * sizeof(unsigned long long)));
      TIERCACHE_CUDA(cudaMemset(rep.report, 0, 3 * sizeof(unsigned long long)));
      if (k == 0) {
        rep.path = Path::kSource;
      } else if (rep.device == devices[0]) {
        rep.path = Path::kSameCard;
      } else {
        int can = 0;
        TIERCACHE_CUDA(cudaDeviceCanAccessPeer(&can, rep.device, devices[0]));
        rep.path = Path::kStaging;
        if (allow_peer && can != 0) {
          cudaError_t err = cudaDeviceEnablePeerAccess(devices[0], 0);
          if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
          else TIERCACHE_CUDA(err);
          rep.path = Path::kPeer;
        }
      }
      // One card listed twice still gets the staging path when peers are refused, so a
      // one-card machine can exercise it.
      if (k > 0 && !allow_peer) rep.path = Path::kStaging;
      TIERCACHE_CUDA(cudaDeviceSynchronize());
    }
    DeviceGuard guard(devices[0]);
    TIERCACHE_CUDA(cudaHostAlloc(&s.staging, s.staging_rows * s.row_bytes(),
                                 cudaHostAllocPortable));
    TIERCACHE_CUDA(cudaEventCreateWithFlags(&s.staging_filled, cudaEventDisableTiming));
  } catch (...) {
    s.release();
    throw;
  }
}

ReplicaSet::~ReplicaSet() {
  if (impl_) impl_->release();
}

std::uint64_t ReplicaSet::broadcast_host(const float* rows, std::uint64_t n) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.writer);
  s.check_usable();
  const std::uint64_t first = s.count.load(std::memory_order_relaxed);
  if (n > s.capacity - first)
    throw TableFullError("replica set full: " + std::to_string(first) + " of " +
                            std::to_string(s.capacity) + " rows used");
  if (n == 0) return first;
  Replica& src = s.replicas[0];
  {
    DeviceGuard guard(src.device);
    TIERCACHE_CUDA(cudaMemcpyAsync(src.rows + first * s.width, rows, n * s.row_bytes(),
                                   cudaMemcpyHostToDevice, src.copy));
    // cudaMemcpyAsync may return before it has read `rows` (always for pinned memory), and the
    // caller reuses `rows` once this returns: wait for the upload. Rows past count() are not
    // published, so an upload that fails leaves nothing to undo.
    TIERCACHE_CUDA(cudaStreamSynchronize(src.copy));
  }
  s.replicate_or_poison(first, n);
  return first;
}

void ReplicaSet::broadcast_range(std::uint64_t first, std::uint64_t n) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.writer);
  s.check_usable();
  const std::uint64_t count = s.count.load(std::memory_order_relaxed);
  if (first != count)
    throw std::invalid_argument("broadcast_range must continue at row " + std::to_string(count));
  if (n > s.capacity - first) throw TableFullError("replica set full");
  if (n == 0) return;
  s.replicate_or_poison(first, n);
}

std::uint64_t ReplicaSet::count() const {
  return impl_->count.load(std::memory_order_acquire);
}
std::size_t ReplicaSet::replicas() const { return impl_->replicas.size(); }
std::uint32_t ReplicaSet::width() const { return impl_->width; }
std::uint64_t ReplicaSet::capacity() const { return impl_->capacity; }

std::vector<std::string> ReplicaSet::paths() const {
  std::vector<std::string> out;
  for (const Replica& r : impl_->replicas) out.emplace_back(path_name(r.path));
  return out;
}

std::uint64_t ReplicaSet::replica_count(std::size_t replica) {
  impl_->check_range(replica, 0, 0);
  Replica& r = impl_->replicas[replica];
  DeviceGuard guard(r.device);
  std::uint64_t value = 0;
  TIERCACHE_CUDA(cudaMemcpyAsync(&value, r.count, sizeof(value), cudaMemcpyDeviceToHost, r.reader));
  TIERCACHE_CUDA(cudaStreamSynchronize(r.reader));
  return value;
}

void ReplicaSet::copy_rows(std::size_t replica, float* out, std::uint64_t first, std::uint64_t n) {
  Impl& s = *impl_;
  s.check_range(replica, first, n);
  Replica& r = s.replicas[replica];
  DeviceGuard guard(r.device);
  TIERCACHE_CUDA(cudaMemcpyAsync(out, r.rows + first * s.width, n * s.row_bytes(),
                                 cudaMemcpyDeviceToHost, r.reader));
  TIERCACHE_CUDA(cudaStreamSynchronize(r.reader));
}

void ReplicaSet::launch_reader_checks() {
  Impl& s = *impl_;
  if (s.width < 2) throw std::logic_error("check rows need a width of at least 2");
  for (Replica& r : s.replicas) {
    DeviceGuard guard(r.device);
    const unsigned int blocks = detail::blocks_for(s.capacity, 256);
    TIERCACHE_CUDA(detail::launch_kernel(check_rows_kernel, blocks, detail::kThreads, r.reader,
                                         r.rows, r.count, s.width, r.report));
  }
}

std::vector<std::vector<std::uint64_t>> ReplicaSet::reader_report() {
  std::vector<std::vector<std::uint64_t>> out;
  for (Replica& r : impl_->replicas) {
    DeviceGuard guard(r.device);
    unsigned long long host[3] = {0, 0, 0};
    TIERCACHE_CUDA(cudaMemcpyAsync(host, r.report, sizeof(host), cudaMemcpyDeviceToHost, r.reader));
    TIERCACHE_CUDA(cudaStreamSynchronize(r.reader));
    out.push_back({host[0], host[1], host[2]});
  }
  return out;
}

void ReplicaSet::synchronize() {
  for (Replica& r : impl_->replicas) {
    DeviceGuard guard(r.device);
    TIERCACHE_CUDA(cudaStreamSynchronize(r.copy));
    TIERCACHE_CUDA(cudaStreamSynchronize(r.reader));
  }
}

std::uint64_t ReplicaSet::reader_stream_handle(std::size_t replica) const {
  impl_->check_range(replica, 0, 0);
  return reinterpret_cast<std::uint64_t>(impl_->replicas[replica].reader);
}

std::uint64_t ReplicaSet::published_event_handle(std::size_t replica) const {
  impl_->check_range(replica, 0, 0);
  return reinterpret_cast<std::uint64_t>(impl_->replicas[replica].published);
}

std::uint64_t ReplicaSet::rows_pointer(std::size_t replica) const {
  impl_->check_range(replica, 0, 0);
  return reinterpret_cast<std::uint64_t>(impl_->replicas[replica].rows);
}

std::uint64_t ReplicaSet::count_pointer(std::size_t replica) const {
  impl_->check_range(replica, 0, 0);
  return reinterpret_cast<std::uint64_t>(impl_->replicas[replica].count);
}

}  // namespace cuda
}  // namespace tiercache
