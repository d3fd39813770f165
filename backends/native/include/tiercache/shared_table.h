// A table of fixed-width float32 rows in a shared file mapping, appended by any process on the
// host and read by all of them without locks.
//
// Publication protocol (the reason this is C++ and not Python):
//   writer: take the writer lock -> copy rows (and ids) past the published count
//           -> store count + n with release ordering -> unlock
//   reader: load count with acquire ordering -> read rows [0, count)
// The release store orders every row byte before the new count; the acquire load orders the
// count before every row read after it. x86 gives this ordering to plain stores and loads;
// weakly ordered hosts (Arm, e.g. NVIDIA Grace) do not, so it has to be said explicitly.
//
// Rows below the published count never change again (the table is append-only), so a reader's
// view stays valid for as long as it holds the mapping.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace tiercache {

// The file is not a table of the requested shape (magic, layout version, width, capacity, size),
// or its published or claimed row count is past its capacity (damaged).
class TableFormatError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Publishing would exceed the capacity; nothing was published.
class TableFullError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The table was retired (replaced by a newer file); writers must reopen its path.
class TableRetiredError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The writer lock was not acquired within the timeout (a live writer holds it).
class LockTimeoutError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A MAP_SHARED mapping of a whole table file; unmapped when the last owner lets go. Shared by
// the table and by every zero-copy view handed out, so a view outlives `SharedTable::close`.
class Mapping {
 public:
  Mapping(void* base, std::size_t bytes) : base_(base), bytes_(bytes) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* base() const { return static_cast<char*>(base_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* base_;
  std::size_t bytes_;
};

struct TableHeader;  // the file's first page; see shared_table.cpp

struct PublishOptions {
  double lock_timeout_s = -1.0;      // < 0 or > 1e9 (inf): wait for the writer lock as long
                                     // as it takes; NaN: std::invalid_argument
  double pause_after_copy_s = 0.0;   // test hook: sleep holding the lock, rows copied, unpublished
};

struct PublishResult {
  std::uint64_t first;      // index of the first published row
  bool recovered;           // this call found a dead writer's lock and recovered it
};

class SharedTable {
 public:
  // Opens the table file at `path`, creating it when absent. Creation is atomic: the file is
  // built complete under a private name and linked into place, so no process ever opens a
  // half-initialized header. An existing file must hold a table of exactly this width and
  // capacity, with its row counts inside it (TableFormatError otherwise). Created 0600. The first open after a reboot empties the table and
  // bumps its generation: page write-back after a crash is unordered, so rows are trusted only
  // within the boot that wrote them.
  SharedTable(const std::string& path, std::uint32_t width, std::uint64_t capacity);
  ~SharedTable() = default;
  SharedTable(const SharedTable&) = delete;
  SharedTable& operator=(const SharedTable&) = delete;

  // Appends `n` rows of `width()` floats; `ids` (n values) or nullptr for the rows' indices.
  PublishResult publish(const float* rows, const std::uint64_t* ids, std::uint64_t n,
                        const PublishOptions& options = {});

  std::uint64_t count() const;       // published rows (acquire)
  std::uint64_t claimed() const;     // end of the rows a writer is copying (== count when idle)
  std::uint64_t generation() const;  // bumped by each recovery of a dead writer and each reset
  bool retired() const;
  // Marks the table as replaced: publish raises TableRetiredError from now on, and readers that
  // poll `retired()` reopen the path (where the replacement was renamed into place).
  void retire();
  // The clock the writer lock's deadline runs on: "monotonic" (glibc >= 2.30) or "realtime".
  static const char* lock_clock();

  std::uint64_t capacity() const { return capacity_; }
  std::uint32_t width() const { return width_; }
  const std::string& path() const { return path_; }

  const float* rows() const;
  const std::uint64_t* ids() const;
  // Keeps the file mapped; hand it to whatever must outlive this object.
  const std::shared_ptr<Mapping>& mapping() const { return mapping_; }

  // Refuses every later call (std::logic_error). The file stays mapped until this object and
  // every holder of mapping() are gone, so a publish running on another thread when close()
  // is called finishes safely.
  void close() { closed_.store(true, std::memory_order_release); }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  TableHeader* header() const;
  void lock_writer(const PublishOptions& options, bool* recovered);

  std::string path_;
  std::uint32_t width_;
  std::uint64_t capacity_;
  std::shared_ptr<Mapping> mapping_;
  std::atomic<bool> closed_{false};
};

// A full (sequentially consistent) fence, for callers that order their own shared data.
void fence();

// The layout version written into new files and required of existing ones.
constexpr std::uint32_t kTableLayoutVersion = 1;

}  // namespace tiercache
