// The CUDA API of a build without CUDA: it reports no devices and refuses to construct.
#include "tiercache/cuda.h"

namespace tiercache {
namespace cuda {

namespace {
[[noreturn]] void unavailable() {
  throw CudaUnavailableError(
      "tiercache_native was built without CUDA (no CUDA compiler was found at build time)");
}
}  // namespace

bool compiled() { return false; }
int device_count() { return 0; }
std::string status() { return "built without CUDA"; }

struct DeviceTable::Impl {};
DeviceTable::DeviceTable(int, std::uint32_t, std::uint64_t, bool) { unavailable(); }
DeviceTable::~DeviceTable() = default;
std::uint64_t DeviceTable::publish_host(const float*, std::uint64_t) { unavailable(); }
std::uint64_t DeviceTable::publish_device(const float*, std::uint64_t, std::uint64_t) {
  unavailable();
}
std::uint64_t DeviceTable::count() const { unavailable(); }
std::uint64_t DeviceTable::host_count() const { unavailable(); }
const float* DeviceTable::host_mirror() const { unavailable(); }
std::uint64_t DeviceTable::device_count() { unavailable(); }
void DeviceTable::copy_rows(float*, std::uint64_t, std::uint64_t) { unavailable(); }
void DeviceTable::synchronize() { unavailable(); }
std::vector<std::uint64_t> DeviceTable::watch_mirror(std::uint64_t, double) const {
  unavailable();
}
int DeviceTable::device() const { unavailable(); }
std::uint32_t DeviceTable::width() const { unavailable(); }
std::uint64_t DeviceTable::capacity() const { unavailable(); }
std::uint64_t DeviceTable::stream_handle() const { unavailable(); }
std::uint64_t DeviceTable::rows_pointer() const { unavailable(); }

struct ReplicaSet::Impl {};
ReplicaSet::ReplicaSet(std::vector<int>, std::uint32_t, std::uint64_t, bool, std::uint64_t) {
  unavailable();
}
ReplicaSet::~ReplicaSet() = default;
std::uint64_t ReplicaSet::broadcast_host(const float*, std::uint64_t) { unavailable(); }
void ReplicaSet::broadcast_range(std::uint64_t, std::uint64_t) { unavailable(); }
std::uint64_t ReplicaSet::count() const { unavailable(); }
std::size_t ReplicaSet::replicas() const { unavailable(); }
std::uint32_t ReplicaSet::width() const { unavailable(); }
std::uint64_t ReplicaSet::capacity() const { unavailable(); }
std::vector<std::string> ReplicaSet::paths() const { unavailable(); }
std::uint64_t ReplicaSet::replica_count(std::size_t) { unavailable(); }
void ReplicaSet::copy_rows(std::size_t, float*, std::uint64_t, std::uint64_t) { unavailable(); }
void ReplicaSet::launch_reader_checks() { unavailable(); }
std::vector<std::vector<std::uint64_t>> ReplicaSet::reader_report() { unavailable(); }
void ReplicaSet::synchronize() { unavailable(); }
std::uint64_t ReplicaSet::reader_stream_handle(std::size_t) const { unavailable(); }
std::uint64_t ReplicaSet::published_event_handle(std::size_t) const { unavailable(); }
std::uint64_t ReplicaSet::rows_pointer(std::size_t) const { unavailable(); }
std::uint64_t ReplicaSet::count_pointer(std::size_t) const { unavailable(); }

}  // namespace cuda
}  // namespace tiercache
