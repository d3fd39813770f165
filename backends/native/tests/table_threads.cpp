// Writers and readers of one SharedTable on threads of one process. Built plainly (a ctest) and
// with ThreadSanitizer (TIERCACHE_TSAN=ON), where the same run checks that every row a reader
// touches happens-after its writer's copy: TSan follows the release store of the count and the
// acquire load of it, and reports the memcpy into a row racing with a read of that row if the
// ordering is missing (see the relaxed variant).
//
// usage: table_threads <table file> [writers] [readers] [rows per writer]
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "tiercache/check_rows.h"
#include "tiercache/shared_table.h"

namespace {

constexpr std::uint32_t kWidth = 16;

struct ReaderResult {
  std::uint64_t snapshots = 0;
  std::uint64_t rows_checked = 0;
  std::uint64_t bad_rows = 0;
  std::uint64_t out_of_order = 0;
};

void write_rows(tiercache::SharedTable& table, std::uint64_t writer, std::uint64_t rows) {
  std::vector<float> batch;
  std::vector<std::uint64_t> ids;
  std::uint64_t seq = 0;
  while (seq < rows) {
    const std::uint64_t n = std::min<std::uint64_t>(1 + seq % 7, rows - seq);
    batch.assign(n * kWidth, 0.0f);
    ids.resize(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      ids[i] = (writer << 32) | (seq + i);
      tiercache::check::fill_row(batch.data() + i * kWidth, kWidth, ids[i]);
    }
    table.publish(batch.data(), ids.data(), n);
    seq += n;
  }
}

ReaderResult read_rows(const tiercache::SharedTable& table, std::uint64_t writers,
                       std::uint64_t total) {
  ReaderResult r;
  std::vector<std::int64_t> last_seq(writers, -1);
  std::uint64_t checked = 0;
  while (checked < total) {
    const std::uint64_t n = table.count();
    ++r.snapshots;
    const float* rows = table.rows();
    const std::uint64_t* ids = table.ids();
    for (; checked < n; ++checked) {
      const std::uint64_t id = ids[checked];
      if (!tiercache::check::row_ok(rows + checked * kWidth, kWidth, id)) ++r.bad_rows;
      const std::uint64_t writer = id >> 32;
      const auto seq = static_cast<std::int64_t>(id & 0xffffffffu);
      if (writer >= writers || seq <= last_seq[writer]) {
        ++r.out_of_order;
      } else {
        last_seq[writer] = seq;
      }
      ++r.rows_checked;
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <table file> [writers] [readers] [rows per writer]\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  const std::uint64_t writers = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 4;
  const std::uint64_t readers = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 4;
  const std::uint64_t rows = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 2000;
  const std::uint64_t total = writers * rows;
  ::unlink(path.c_str());
  // One mapping shared by every thread: TSan tracks virtual addresses, and two mappings of the
  // same file would look like unrelated memory to it (so processes are out of its reach).
  tiercache::SharedTable table(path, kWidth, total);

  std::vector<ReaderResult> results(readers);
  std::vector<std::thread> threads;
  for (std::uint64_t i = 0; i < readers; ++i)
    threads.emplace_back([&, i] { results[i] = read_rows(table, writers, total); });
  std::vector<std::thread> writer_threads;
  for (std::uint64_t w = 0; w < writers; ++w)
    writer_threads.emplace_back([&, w] { write_rows(table, w, rows); });
  for (auto& t : writer_threads) t.join();
  for (auto& t : threads) t.join();

  ReaderResult sum;
  for (const auto& r : results) {
    sum.snapshots += r.snapshots;
    sum.rows_checked += r.rows_checked;
    sum.bad_rows += r.bad_rows;
    sum.out_of_order += r.out_of_order;
  }
  std::printf(
      "writers=%llu readers=%llu rows=%llu count=%llu snapshots=%llu rows_checked=%llu "
      "bad_rows=%llu out_of_order=%llu\n",
      static_cast<unsigned long long>(writers), static_cast<unsigned long long>(readers),
      static_cast<unsigned long long>(total), static_cast<unsigned long long>(table.count()),
      static_cast<unsigned long long>(sum.snapshots),
      static_cast<unsigned long long>(sum.rows_checked),
      static_cast<unsigned long long>(sum.bad_rows),
      static_cast<unsigned long long>(sum.out_of_order));
  ::unlink(path.c_str());
  const bool ok = table.count() == total && sum.bad_rows == 0 && sum.out_of_order == 0 &&
                  sum.rows_checked == readers * total;
  return ok ? 0 : 1;
}
