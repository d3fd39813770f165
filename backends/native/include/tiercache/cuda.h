// The device side of the table: publication of rows into one card's memory with a count the
// host can read, and replication of new rows to every card in order. Plain C++ (no CUDA
// types), so the bindings and non-CUDA builds share it; without CUDA every constructor throws
// CudaUnavailableError.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tiercache {
namespace cuda {

// No CUDA in this build, no usable device, or a device index out of range.
class CudaUnavailableError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Any other CUDA runtime error, with the call and the runtime's message.
class CudaError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool compiled();
// Usable devices; 0 when not compiled, without a driver, or without a device (never throws).
int device_count();
// One line: why device_count() is what it is ("2 devices", "no CUDA driver: ...", ...).
std::string status();

// Rows of one card, appended by one writer in this process.
//
// publish: one kernel copies the rows into the table (and into a pinned host mirror, if asked
// for), each thread issues __threadfence_system() after its stores, and the last block to
// finish stores the new count into device memory and into a host-mapped flag. A host thread
// that loads the flag with acquire ordering therefore sees every row below it in the mirror.
class DeviceTable {
 public:
  DeviceTable(int device, std::uint32_t width, std::uint64_t capacity, bool host_mirror);
  ~DeviceTable();
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;

  // Both return the first index, and count() covers the rows once the call returns. A call
  // that throws before its kernel is queued publishes nothing, and the next publish starts at
  // the same index (no hole); publish_device can still throw after that, with the rows counted.
  //
  // publish_host: `rows` in host memory (pageable or pinned) has been copied when the call
  // returns (it waits for the copy), so the caller may reuse it; the kernel is asynchronous.
  std::uint64_t publish_host(const float* rows, std::uint64_t n);
  // publish_device: `device_rows` on this card, float32, contiguous. The kernel runs after the
  // work queued so far on `caller_stream` (a cudaStream_t of this card as an integer; 0 is the
  // legacy default stream), which wrote the rows, and later work queued on `caller_stream`
  // runs after the kernel has read them. Until then the rows must stay allocated and
  // unchanged: wait for synchronize(), unless their memory is reused or rewritten only by work
  // queued on `caller_stream` (e.g. by a stream-ordered allocator, on that stream).
  std::uint64_t publish_device(const float* device_rows, std::uint64_t n,
                               std::uint64_t caller_stream);

  std::uint64_t count() const;       // rows published so far, kernels in flight included
  std::uint64_t host_count() const;  // acquire load of the host-visible flag
  const float* host_mirror() const;  // nullptr without a mirror
  std::uint64_t device_count();      // the count in device memory, after synchronize()
  void copy_rows(float* out, std::uint64_t first, std::uint64_t n);  // device -> host, synced
  void synchronize();

  // Spins on the host flag until it reaches `until` (or timeout), checking each newly visible
  // mirror row with check::row_ok (id = row index). Returns {polls, distinct counts seen,
  // bad rows, last count seen}. For the GPU checks: rows must be check rows, mirror on.
  std::vector<std::uint64_t> watch_mirror(std::uint64_t until, double timeout_s) const;

  int device() const;
  std::uint32_t width() const;
  std::uint64_t capacity() const;
  std::uint64_t stream_handle() const;  // the cudaStream_t publications run on
  std::uint64_t rows_pointer() const;   // device address of row 0

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// One replica of a table on each listed card (a card may be listed twice, e.g. to exercise
// the staging path on a one-card machine). Replica 0 is the source.
//
// broadcast: rows go to replica 0, then to every other replica by a peer copy where peer
// access is on, else through pinned host memory; on each card a reader stream waits on the
// copy's event before a one-thread kernel stores the new count. Work on a replica's reader
// stream (or on a stream that waits on published_event) sees the rows before the count.
class ReplicaSet {
 public:
  ReplicaSet(std::vector<int> devices, std::uint32_t width, std::uint64_t capacity,
             bool allow_peer, std::uint64_t staging_rows);
  ~ReplicaSet();
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  // Uploads `rows` (host memory, pageable or pinned) to replica 0 and replicates them; returns
  // the first index. The upload is done when the call returns, so the caller may reuse `rows`;
  // the replication is asynchronous.
  std::uint64_t broadcast_host(const float* rows, std::uint64_t n);
  // Replicates rows [first, first + n) that are already in replica 0 (e.g. written there by a
  // DeviceTable sharing its memory, or by the caller) and publishes count first + n.
  void broadcast_range(std::uint64_t first, std::uint64_t n);
  // A broadcast that fails partway (a CUDA error while replicating) may have published its
  // count on some replicas and not on others. The set is then poisoned: every later broadcast
  // throws CudaError, so no row index a reader may have seen is ever written again.

  std::uint64_t count() const;  // rows fully broadcast so far (host side)
  std::size_t replicas() const;
  std::uint32_t width() const;
  std::uint64_t capacity() const;
  std::vector<std::string> paths() const;  // per replica: source, peer, same-card, staging
  std::uint64_t replica_count(std::size_t replica);  // read on its reader stream, synced
  void copy_rows(std::size_t replica, float* out, std::uint64_t first, std::uint64_t n);

  // Launches, on every reader stream, a kernel that reads the count and checks every row
  // below it (check rows, id = index); asynchronous, results accumulate on the device.
  void launch_reader_checks();
  // Per replica: {checks run, bad rows seen, largest count seen}; synchronizes.
  std::vector<std::vector<std::uint64_t>> reader_report();
  void synchronize();

  std::uint64_t reader_stream_handle(std::size_t replica) const;
  std::uint64_t published_event_handle(std::size_t replica) const;
  std::uint64_t rows_pointer(std::size_t replica) const;
  std::uint64_t count_pointer(std::size_t replica) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace tiercache
