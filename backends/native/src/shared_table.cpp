#include "tiercache/shared_table.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <type_traits>

namespace tiercache {

namespace {

// The negative control of the ThreadSanitizer test builds this file with relaxed publication,
// which is the bug x86 hides: TSan must then report the race (see backends/native/tests).
#ifdef TIERCACHE_TEST_RELAXED_PUBLISH
constexpr std::memory_order kPublishOrder = std::memory_order_relaxed;
constexpr std::memory_order kReadOrder = std::memory_order_relaxed;
#else
constexpr std::memory_order kPublishOrder = std::memory_order_release;
constexpr std::memory_order kReadOrder = std::memory_order_acquire;
#endif

constexpr char kMagic[8] = {'T', 'C', 'S', 'H', 'T', 'B', 'L', '\0'};
constexpr std::size_t kPage = 4096;
constexpr std::uint32_t kMaxWidth = 1u << 16;
constexpr std::uint64_t kMaxRowBytes = std::uint64_t{1} << 42;  // 4 TiB of rows

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

// Fault in the pages of a large copy's destination with one call: first touches of a shared
// file mapping cost a fault per 4 KiB page otherwise (bench_native_table.py: about 1.0 ->
// 0.6 us per 384-float row in batches of 1,024). Advisory: kernels before 5.14 ignore it.
constexpr std::size_t kPopulateMinBytes = 64 << 10;

void populate_for_write(char* begin, std::size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (bytes < kPopulateMinBytes) return;
  auto first = reinterpret_cast<std::uintptr_t>(begin) & ~std::uintptr_t{kPage - 1};
  auto end = reinterpret_cast<std::uintptr_t>(begin) + bytes;
  madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE);
#else
  (void)begin;
  (void)bytes;
#endif
}

// Lock timeouts longer than this (about 32 years) wait forever.
constexpr double kForeverS = 1e9;

std::string errno_text(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

}  // namespace

// The start of the file's first page: plain fields, written at creation (boot_id also at the
// reset after a reboot, under the file's flock). Trivially copyable, so it can be read with
// pread to validate a file before mapping it.
struct TableFixed {
  char magic[8];
  std::uint32_t layout_version;
  std::uint32_t header_bytes;
  std::uint64_t capacity;
  std::uint32_t width;
  std::uint32_t reserved0;
  std::uint64_t rows_offset;  // bytes from the start of the file; page aligned
  std::uint64_t ids_offset;   // uint64 per row, after the rows
  std::uint64_t file_bytes;
  char boot_id[48];  // the boot that last initialized the table (Linux boot_id)
};

// The file's first page: the fixed fields, then the shared state, each hot field on its own
// cache line so readers polling `count` do not share a line with the writer's other stores.
struct TableHeader {
  TableFixed fixed;
  alignas(64) std::atomic<std::uint64_t> count;  // published rows
  alignas(64) std::atomic<std::uint64_t> claimed;
  std::atomic<std::uint64_t> generation;
  std::atomic<std::uint32_t> retired;
  alignas(64) pthread_mutex_t writer_lock;  // process-shared, robust
};

static_assert(std::is_trivially_copyable<TableFixed>::value, "read with pread");
static_assert(std::is_standard_layout<TableHeader>::value, "the header is a file layout");
static_assert(sizeof(TableHeader) <= kPage, "the header fits its page");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "lock-free atomics are address-free, so they work across processes");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "see above");

Mapping::~Mapping() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

namespace {

std::string current_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id.substr(0, 47);
}

void init_writer_lock(pthread_mutex_t* lock) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  int rc = pthread_mutex_init(lock, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) throw std::runtime_error(errno_text("pthread_mutex_init", rc));
}

void set_boot_id(TableFixed* h, const std::string& boot_id) {
  std::memset(h->boot_id, 0, sizeof(h->boot_id));
  std::memcpy(h->boot_id, boot_id.data(), std::min(boot_id.size(), sizeof(h->boot_id) - 1));
}

struct Layout {
  std::uint64_t rows_offset, ids_offset, file_bytes;
};

Layout layout_for(std::uint32_t width, std::uint64_t capacity) {
  Layout l{};
  l.rows_offset = kPage;
  l.ids_offset = round_up(l.rows_offset + capacity * width * sizeof(float), 64);
  l.file_bytes = round_up(l.ids_offset + capacity * sizeof(std::uint64_t), kPage);
  return l;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Builds a complete, empty table under a private name and links it to `path`. Losing the race
// to another creator is fine: its file is just as complete.
void create_table_file(const std::string& path, std::uint32_t width, std::uint64_t capacity) {
  std::random_device rd;
  std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(rd());
  // 0600: a table holds prompt vectors of every tenant of the host.
  Fd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw std::runtime_error(errno_text("cannot create " + tmp, errno));
  struct Unlink {
    const std::string& p;
    ~Unlink() { ::unlink(p.c_str()); }
  } unlink_tmp{tmp};

  Layout l = layout_for(width, capacity);
  // Reserve the blocks now: a full disk then fails here with a clear error rather than with
  // SIGBUS in the middle of a later publish.
  int rc = posix_fallocate(fd.get(), 0, static_cast<off_t>(l.file_bytes));
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ftruncate(fd.get(), l.file_bytes) == 0 ? 0 : errno;
  if (rc != 0) throw std::runtime_error(errno_text("cannot size " + tmp, rc));

  void* base = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) throw std::runtime_error(errno_text("mmap " + tmp, errno));
  Mapping header_page(base, kPage);
  auto* h = new (base) TableHeader();
  std::memcpy(h->fixed.magic, kMagic, sizeof(kMagic));
  h->fixed.layout_version = kTableLayoutVersion;
  h->fixed.header_bytes = sizeof(TableHeader);
  h->fixed.capacity = capacity;
  h->fixed.width = width;
  h->fixed.rows_offset = l.rows_offset;
  h->fixed.ids_offset = l.ids_offset;
  h->fixed.file_bytes = l.file_bytes;
  // A table stores the boot that wrote it, so that the first open after a reboot starts it
  // empty; without one, a later process that can read it would reset a table in use.
  std::string boot_id = current_boot_id();
  if (boot_id.empty())
    throw std::runtime_error("cannot read /proc/sys/kernel/random/boot_id: a table needs it");
  set_boot_id(&h->fixed, boot_id);
  h->count.store(0, std::memory_order_relaxed);
  h->claimed.store(0, std::memory_order_relaxed);
  h->generation.store(0, std::memory_order_relaxed);
  h->retired.store(0, std::memory_order_relaxed);
  init_writer_lock(&h->writer_lock);

  if (::link(tmp.c_str(), path.c_str()) != 0 && errno != EEXIST)
    throw std::runtime_error(errno_text("cannot link " + tmp + " to " + path, errno));
}

void check_header(const TableFixed& h, const std::string& path, std::uint32_t width,
                  std::uint64_t capacity, std::uint64_t file_size) {
  auto fail = [&](const std::string& why) { throw TableFormatError(path + ": " + why); };
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) fail("not a tiercache table (bad magic)");
  if (h.layout_version != kTableLayoutVersion)
    fail("layout version " + std::to_string(h.layout_version) + ", this build reads " +
         std::to_string(kTableLayoutVersion));
  if (h.header_bytes != sizeof(TableHeader)) fail("header size differs from this build's");
  if (h.width != width)
    fail("rows are " + std::to_string(h.width) + " floats wide, not " + std::to_string(width));
  if (h.capacity != capacity)
    fail("capacity is " + std::to_string(h.capacity) + " rows, not " + std::to_string(capacity));
  Layout l = layout_for(width, capacity);
  if (h.rows_offset != l.rows_offset || h.ids_offset != l.ids_offset ||
      h.file_bytes != l.file_bytes)
    fail("inconsistent layout");
  if (file_size < h.file_bytes)
    fail("file is " + std::to_string(file_size) + " bytes, the header says " +
         std::to_string(h.file_bytes));
}

// The shared counters must describe rows inside the table: a count past the capacity (a
// damaged or forged file) would make every reader's view and the next publish run off the end
// of the mapping.
void check_counts(const TableHeader& h, const std::string& path, std::uint64_t capacity) {
  std::uint64_t count = h.count.load(kReadOrder);
  std::uint64_t claimed = h.claimed.load(std::memory_order_relaxed);
  if (count > capacity || claimed > capacity)
    throw TableFormatError(path + ": the header says " + std::to_string(count) +
                           " rows are published (" + std::to_string(claimed) +
                           " claimed) in a table of " + std::to_string(capacity) +
                           " rows; the file is damaged");
}

}  // namespace

SharedTable::SharedTable(const std::string& path, std::uint32_t width, std::uint64_t capacity)
    : path_(path), width_(width), capacity_(capacity) {
  if (width == 0 || width > kMaxWidth)
    throw std::invalid_argument("width must be in [1, " + std::to_string(kMaxWidth) + "]");
  if (capacity == 0 || capacity > kMaxRowBytes / (std::uint64_t{width} * sizeof(float)))
    throw std::invalid_argument("capacity must be at least 1 and the rows at most 4 TiB");

  // O_NOFOLLOW: a link planted at the table's name is refused, not followed to another file.
  int raw = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  for (int attempt = 0; raw < 0 && errno == ENOENT && attempt < 3; ++attempt) {
    // Absent (or unlinked by another process's cleanup between its link and this open).
    create_table_file(path, width, capacity);
    raw = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  }
  if (raw < 0) throw std::runtime_error(errno_text("cannot open " + path, errno));
  Fd fd(raw);

  // Only a table this user made, private to it, is mapped (before anything waits on it): a
  // file another local user could write would let them read every tenant's vectors, rewrite
  // published rows, truncate it under the readers, or hold its lock for ever.
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw std::runtime_error(errno_text("fstat " + path, errno));
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) != 0)
    throw std::runtime_error(path + ": not a private regular file of this user (mode " +
                             std::to_string(st.st_mode & 07777) + ", owner " +
                             std::to_string(st.st_uid) + "); refused");

  // Validation and the reboot reset run under an exclusive flock, so two processes opening a
  // stale file reset it once. flock is released by the kernel if this process dies.
  if (flock(fd.get(), LOCK_EX) != 0) throw std::runtime_error(errno_text("flock " + path, errno));
  if (fstat(fd.get(), &st) != 0) throw std::runtime_error(errno_text("fstat " + path, errno));
  if (static_cast<std::uint64_t>(st.st_size) < kPage)
    throw TableFormatError(path + ": too short to be a tiercache table");
  TableFixed probe{};
  if (pread(fd.get(), &probe, sizeof(probe), 0) !=
      static_cast<ssize_t>(sizeof(probe)))
    throw std::runtime_error(errno_text("cannot read the header of " + path, errno));
  check_header(probe, path, width, capacity, static_cast<std::uint64_t>(st.st_size));

  void* base = mmap(nullptr, probe.file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) throw std::runtime_error(errno_text("mmap " + path, errno));
  mapping_ = std::make_shared<Mapping>(base, probe.file_bytes);

  TableHeader* h = header();
  std::string boot_id = current_boot_id();
  const char* stored = h->fixed.boot_id;
  // Reset only when both boots are known: an empty stored id (a file made where the boot id
  // could not be read) or an unreadable current one proves no reboot.
  if (!boot_id.empty() && stored[0] != '\0' &&
      std::strncmp(stored, boot_id.c_str(), sizeof(h->fixed.boot_id)) != 0) {
    // Written in an earlier boot: no process of that boot is alive to hold the lock, and the
    // rows may have reached the disk out of order. Start empty.
    init_writer_lock(&h->writer_lock);
    h->count.store(0, std::memory_order_release);
    h->claimed.store(0, std::memory_order_relaxed);
    h->retired.store(0, std::memory_order_relaxed);
    h->generation.fetch_add(1, std::memory_order_acq_rel);
    set_boot_id(&h->fixed, boot_id);
  }
  try {
    check_counts(*h, path, capacity);
  } catch (const TableFormatError&) {
    // Damaged: whoever opened it before keeps reading it through its mapping. Retired, they
    // reopen through the manifest, where the rebuilt table is (semantic/shared_rows.py).
    h->retired.store(1, std::memory_order_release);
    throw;  // the flock is released by ~Fd
  }
  flock(fd.get(), LOCK_UN);
}

TableHeader* SharedTable::header() const {
  if (closed()) throw std::logic_error("the table is closed");
  return reinterpret_cast<TableHeader*>(mapping_->base());
}

// Offsets come from this object's validated shape, not from the shared header, which another
// process could overwrite after the open.
const float* SharedTable::rows() const {
  header();  // refuses a closed table
  return reinterpret_cast<const float*>(mapping_->base() +
                                        layout_for(width_, capacity_).rows_offset);
}

const std::uint64_t* SharedTable::ids() const {
  header();
  return reinterpret_cast<const std::uint64_t*>(mapping_->base() +
                                                layout_for(width_, capacity_).ids_offset);
}

std::uint64_t SharedTable::count() const {
  std::uint64_t count = header()->count.load(kReadOrder);
  if (count > capacity_)  // damaged since the open: never hand out a view past the mapping
    throw TableFormatError(path_ + ": the header says " + std::to_string(count) +
                           " rows are published in a table of " + std::to_string(capacity_) +
                           " rows; the file is damaged");
  return count;
}

std::uint64_t SharedTable::claimed() const {
  return header()->claimed.load(std::memory_order_relaxed);
}

std::uint64_t SharedTable::generation() const {
  return header()->generation.load(std::memory_order_acquire);
}

bool SharedTable::retired() const {
  return header()->retired.load(std::memory_order_acquire) != 0;
}

void SharedTable::retire() { header()->retired.store(1, std::memory_order_release); }

namespace {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
constexpr clockid_t kLockClock = CLOCK_MONOTONIC;
int timed_lock(pthread_mutex_t* mutex, const timespec& deadline) {
  return pthread_mutex_clocklock(mutex, CLOCK_MONOTONIC, &deadline);
}
#else
constexpr clockid_t kLockClock = CLOCK_REALTIME;
int timed_lock(pthread_mutex_t* mutex, const timespec& deadline) {
  return pthread_mutex_timedlock(mutex, &deadline);
}
#endif
}  // namespace

const char* SharedTable::lock_clock() {
  return kLockClock == CLOCK_MONOTONIC ? "monotonic" : "realtime";
}

void SharedTable::lock_writer(const PublishOptions& options, bool* recovered) {
  if (std::isnan(options.lock_timeout_s))
    throw std::invalid_argument("lock_timeout_s is NaN (< 0 or inf: wait forever)");
  TableHeader* h = header();
  int rc;
  // Converting inf, or anything past time_t's range, to time_t is undefined (on x86-64 it gives
  // INT64_MIN: a deadline in the past, so an immediate timeout). Past kForeverS, wait forever.
  if (options.lock_timeout_s < 0 || options.lock_timeout_s > kForeverS) {
    rc = pthread_mutex_lock(&h->writer_lock);
  } else {
    // The deadline runs on CLOCK_MONOTONIC where the C library can wait on it
    // (pthread_mutex_clocklock, glibc >= 2.30), so a step of the wall clock (NTP, an operator)
    // neither ends the wait early nor stretches it; elsewhere, CLOCK_REALTIME as POSIX's
    // pthread_mutex_timedlock requires.
    timespec deadline{};
    clock_gettime(kLockClock, &deadline);
    double whole = std::floor(options.lock_timeout_s);
    deadline.tv_sec += static_cast<time_t>(whole);
    deadline.tv_nsec += static_cast<long>((options.lock_timeout_s - whole) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
      deadline.tv_sec += 1;
      deadline.tv_nsec -= 1000000000L;
    }
    rc = timed_lock(&h->writer_lock, deadline);
  }
  *recovered = false;
  if (rc == EOWNERDEAD) {
    // The previous writer died holding the lock. Everything below `count` was published by
    // complete publishes (count moves only after a copy is done); whatever it copied beyond
    // `count` was never visible and is overwritten by the next publish.
    std::uint64_t published = h->count.load(std::memory_order_relaxed);
    h->claimed.store(published, std::memory_order_relaxed);
    h->generation.fetch_add(1, std::memory_order_acq_rel);
    pthread_mutex_consistent(&h->writer_lock);
    *recovered = true;
    return;
  }
  if (rc == ETIMEDOUT)
    throw LockTimeoutError("the writer lock of " + path_ + " is held by a live writer");
  if (rc != 0) throw std::runtime_error(errno_text("writer lock of " + path_, rc));
}

PublishResult SharedTable::publish(const float* rows, const std::uint64_t* ids, std::uint64_t n,
                                   const PublishOptions& options) {
  TableHeader* h = header();
  PublishResult result{0, false};
  lock_writer(options, &result.recovered);
  struct Unlock {
    pthread_mutex_t* m;
    ~Unlock() { pthread_mutex_unlock(m); }
  } unlock{&h->writer_lock};

  // Only lock holders store `count`, so a relaxed load sees the latest value here.
  std::uint64_t first = h->count.load(std::memory_order_relaxed);
  result.first = first;
  if (h->retired.load(std::memory_order_acquire) != 0)
    throw TableRetiredError(path_ + " was retired; reopen the path");
  if (first > capacity_)
    throw TableFormatError(path_ + ": the header says " + std::to_string(first) +
                           " rows are published in a table of " + std::to_string(capacity_) +
                           " rows; the file is damaged, nothing was published");
  if (n > capacity_ - first)
    throw TableFullError(path_ + ": " + std::to_string(first) + " of " +
                         std::to_string(capacity_) + " rows used, " + std::to_string(n) +
                         " more do not fit; nothing was published");
  if (n == 0) return result;

  h->claimed.store(first + n, std::memory_order_relaxed);
  char* base = mapping_->base();
  const Layout layout = layout_for(width_, capacity_);
  char* destination = base + layout.rows_offset + first * width_ * sizeof(float);
  populate_for_write(destination, n * width_ * sizeof(float));
  std::memcpy(destination, rows, n * width_ * sizeof(float));
  auto* id_slots = reinterpret_cast<std::uint64_t*>(base + layout.ids_offset) + first;
  if (ids != nullptr) {
    std::memcpy(id_slots, ids, n * sizeof(std::uint64_t));
  } else {
    for (std::uint64_t i = 0; i < n; ++i) id_slots[i] = first + i;
  }
  if (options.pause_after_copy_s > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(options.pause_after_copy_s));
  // The publication point: every store above happens-before any load that reads this value.
  h->count.store(first + n, kPublishOrder);
  return result;
}

void fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

}  // namespace tiercache
