// Python bindings of the native library: module tiercache_native._core (nanobind).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tiercache/check_rows.h"
#include "tiercache/cuda.h"
#include "tiercache/shared_table.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using tiercache::SharedTable;
using tiercache::cuda::DeviceTable;
using tiercache::cuda::ReplicaSet;

using HostRows = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
// Any CUDA array, taken as it is: nanobind would otherwise convert the dtype or the layout on
// the producer's stream into a temporary that is freed when the call returns, while the
// publication kernel, on the table's stream, has yet to read it. The binding checks instead.
using CudaArray = nb::ndarray<nb::ro, nb::device::cuda>;
using HostIds = nb::ndarray<const std::uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RowsView = nb::ndarray<nb::numpy, const float, nb::ndim<2>>;
using IdsView = nb::ndarray<nb::numpy, const std::uint64_t, nb::ndim<1>>;
using RowsCopy = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

// Rows as (n, width): a 2-d array of that width, or one row as a 1-d array.
template <typename Rows>
std::uint64_t row_count(const Rows& rows, std::uint32_t width) {
  if (rows.ndim() == 2 && rows.shape(1) == width) return rows.shape(0);
  if (rows.ndim() == 1 && rows.shape(0) == width) return 1;
  std::string shape = "(";
  for (std::size_t i = 0; i < rows.ndim(); ++i)
    shape += (i ? ", " : "") + std::to_string(rows.shape(i));
  throw nb::value_error(("rows must have shape (n, " + std::to_string(width) + "), not " +
                         shape + (rows.ndim() == 1 ? ",)" : ")"))
                            .c_str());
}

// "float16", "bfloat16", "int64", ... (DLPack type codes).
std::string dtype_name(nb::dlpack::dtype dtype) {
  static const char* const kinds[] = {"int",    "uint",    "float", "opaque",
                                      "bfloat", "complex", "bool"};
  const std::string kind =
      dtype.code < 7 ? kinds[dtype.code] : "type code " + std::to_string(dtype.code) + ", bits ";
  return kind + std::to_string(dtype.bits);
}

SharedTable& live(SharedTable& table) {
  if (table.closed()) throw nb::value_error("the table is closed");
  return table;
}

// A capsule that keeps a table file mapped for as long as a view of it exists.
nb::capsule mapping_owner(const SharedTable& table) {
  auto* keep = new std::shared_ptr<tiercache::Mapping>(table.mapping());
  return nb::capsule(keep, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<tiercache::Mapping>*>(p);
  });
}

RowsCopy empty_rows(std::uint64_t n, std::uint32_t width) {
  auto* data = new float[n * width > 0 ? n * width : 1];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return RowsCopy(data, {static_cast<std::size_t>(n), static_cast<std::size_t>(width)}, owner);
}

std::uint64_t resolve_count(std::optional<std::uint64_t> count, std::uint64_t available,
                            std::uint64_t first = 0) {
  if (first > available) throw nb::index_error("first is past the published rows");
  const std::uint64_t n = count.value_or(available - first);
  if (n > available - first)
    throw nb::index_error(("only " + std::to_string(available - first) + " rows from " +
                           std::to_string(first) + ", not " + std::to_string(n))
                              .c_str());
  return n;
}

void bind_table(nb::module_& m) {
  nb::class_<SharedTable>(
      m, "SharedTable",
      "A table of fixed-width float32 rows in a shared file mapping: append-only, published\n"
      "with release ordering, read without locks by every process that opens the file.")
      .def(
          "__init__",
          [](SharedTable* self, const std::filesystem::path& path, std::uint32_t width,
             std::uint64_t capacity) {
            std::string where = path.string();
            // Sizing a new file (posix_fallocate of gigabytes on tmpfs) and the file's flock can
            // take a while: other Python threads (searches) go on meanwhile.
            nb::gil_scoped_release released;
            new (self) SharedTable(where, width, capacity);
          },
          "path"_a, "width"_a, "capacity"_a,
          "Open the table file at `path`, creating it (complete, atomically) when absent.\n"
          "An existing file must hold a table of this width and capacity (TableFormatError).")
      .def(
          "publish",
          [](SharedTable& table, HostRows rows, std::optional<HostIds> ids,
             std::optional<double> timeout_s, double pause_after_copy_s) {
            live(table);
            const std::uint64_t n = row_count(rows, table.width());
            if (ids && ids->shape(0) != n)
              throw nb::value_error(("ids has " + std::to_string(ids->shape(0)) +
                                     " values for " + std::to_string(n) + " rows")
                                        .c_str());
            if (timeout_s && !(*timeout_s >= 0.0))  // negative or NaN
              throw nb::value_error("timeout_s must be >= 0 (None or inf: wait forever)");
            tiercache::PublishOptions options;
            options.lock_timeout_s = timeout_s ? *timeout_s : -1.0;
            if (!std::isfinite(pause_after_copy_s) || pause_after_copy_s < 0.0)
              throw nb::value_error("_pause_after_copy_s must be finite and >= 0");
            options.pause_after_copy_s = pause_after_copy_s;
            nb::gil_scoped_release release;
            return table.publish(rows.data(), ids ? ids->data() : nullptr, n, options).first;
          },
          "rows"_a, "ids"_a = nb::none(), nb::kw_only(), "timeout_s"_a = 10.0,
          "_pause_after_copy_s"_a = 0.0,
          "Append rows (n, width) with one uint64 id each (default: the row's index); returns\n"
          "the first row's index. All or nothing: TableFullError publishes none. Waits up to\n"
          "`timeout_s` for the writer lock (None, inf or over 1e9: forever; TimeoutError after;\n"
          "negative or NaN: ValueError). A writer that died holding the lock is recovered here\n"
          "(generation + 1). `_pause_after_copy_s` is a test hook: sleep holding the lock after\n"
          "the copy, before publication.")
      .def(
          "snapshot",
          [](SharedTable& table) {
            live(table);
            const std::uint64_t n = table.count();
            return RowsView(table.rows(), {static_cast<std::size_t>(n), table.width()},
                            mapping_owner(table));
          },
          "The published rows (count, width): a read-only view of the shared mapping (no copy),\n"
          "valid as long as it lives, also after close(); published rows never change.")
      .def(
          "ids",
          [](SharedTable& table, std::optional<std::uint64_t> count) {
            live(table);
            const std::uint64_t n = resolve_count(count, table.count());
            return IdsView(table.ids(), {static_cast<std::size_t>(n)}, mapping_owner(table));
          },
          "count"_a = nb::none(),
          "The ids of the first `count` published rows (default: all), a read-only view.\n"
          "Pass len(snapshot) to pair them with a snapshot taken before.")
      .def("count", [](SharedTable& t) { return live(t).count(); },
           "Published rows (an acquire load: rows below it are complete).")
      .def("claimed", [](SharedTable& t) { return live(t).claimed(); },
           "End of the rows a writer is copying; equals count() unless a publish is in\n"
           "flight or its writer died mid-publish.")
      .def("capacity", [](SharedTable& t) { return live(t).capacity(); })
      .def("width", [](SharedTable& t) { return live(t).width(); })
      .def("generation", [](SharedTable& t) { return live(t).generation(); },
           "Bumped by each recovery of a dead writer and by the reset of the first open\n"
           "after a reboot (which empties the table).")
      .def("retired", [](SharedTable& t) { return live(t).retired(); },
           "True once retire() was called by any process: reopen the path.")
      .def("retire", [](SharedTable& t) { live(t).retire(); },
           "Mark the table as replaced (after renaming a new file over its path): publish\n"
           "raises TableRetiredError from now on; readers polling retired() reopen.")
      .def_prop_ro("path", [](SharedTable& t) { return t.path(); })
      .def_prop_ro("closed", [](SharedTable& t) { return t.closed(); })
      .def("close", [](SharedTable& t) { t.close(); },
           "Refuse further calls. The file stays mapped until this object and every view of\n"
           "it are gone (so views stay valid).")
      .def(
          "__enter__", [](nb::handle self) { return self; },
          nb::sig("def __enter__(self) -> SharedTable"))
      .def(
          "__exit__", [](SharedTable& t, nb::args) { t.close(); },
          nb::sig("def __exit__(self, *args: object) -> None"), "Close the table.");
}

// Self-checking rows for tests and benchmarks (the same checksum on host and GPU); re-exported
// by tiercache_native.testing.
void bind_testing(nb::module_& t) {
  t.def(
      "make_check_rows",
      [](HostIds ids, std::uint32_t width) {
        if (width < 2) throw nb::value_error("check rows need a width of at least 2");
        const std::uint64_t n = ids.shape(0);
        RowsCopy out = empty_rows(n, width);
        for (std::uint64_t i = 0; i < n; ++i)
          tiercache::check::fill_row(out.data() + i * width, width, ids.data()[i]);
        return out;
      },
      "ids"_a, "width"_a,
      "Rows (len(ids), width) whose values derive from their id and whose last value is a\n"
      "checksum of the others and the id.");
  t.def(
      "count_bad_rows",
      [](HostRows rows, HostIds ids) {
        if (rows.ndim() != 2 || rows.shape(0) != ids.shape(0))
          throw nb::value_error("rows must be (n, width) with one id per row");
        const std::uint32_t width = static_cast<std::uint32_t>(rows.shape(1));
        if (width < 2) throw nb::value_error("check rows need a width of at least 2");
        std::uint64_t bad = 0;
        const float* data = rows.data();
        const std::uint64_t* id = ids.data();
        const std::uint64_t n = rows.shape(0);
        nb::gil_scoped_release release;
        for (std::uint64_t i = 0; i < n; ++i)
          if (!tiercache::check::row_ok(data + i * width, width, id[i])) ++bad;
        return bad;
      },
      "rows"_a, "ids"_a, "How many rows fail their checksum (torn, or never written).");
}

void bind_cuda(nb::module_& m) {
  m.def("cuda_compiled", &tiercache::cuda::compiled, "Whether this build has the CUDA part.");
  m.def("cuda_device_count", &tiercache::cuda::device_count,
        "Usable CUDA devices; 0 without CUDA, a driver or a device.");
  m.def("cuda_status", &tiercache::cuda::status, "Why cuda_device_count() is what it is.");

  nb::class_<DeviceTable>(
      m, "DeviceTable",
      "Rows in one card's memory, published by a kernel that fences each row with\n"
      "__threadfence_system() before storing the count into device memory and into a\n"
      "host-mapped flag (host_count). One writer per object.")
      .def(
          "__init__",
          [](DeviceTable* self, std::uint32_t width, std::uint64_t capacity, int device,
             bool host_mirror) { new (self) DeviceTable(device, width, capacity, host_mirror); },
          "width"_a, "capacity"_a, "device"_a = 0, "host_mirror"_a = false,
          "A table of `capacity` rows of `width` floats on card `device`; `host_mirror` also\n"
          "writes every row into pinned host memory (host_snapshot), for visibility checks.")
      .def(
          "publish",
          [](DeviceTable& t, CudaArray rows, std::uint64_t stream) {
            const std::uint64_t n = row_count(rows, t.width());
            if (rows.device_id() != t.device())
              throw nb::value_error(("rows are on CUDA device " + std::to_string(rows.device_id()) +
                                     ", the table on " + std::to_string(t.device()))
                                        .c_str());
            if (rows.dtype() != nb::dtype<float>())
              throw nb::type_error(("CUDA rows must be float32, not " + dtype_name(rows.dtype()) +
                                    ": device arrays are not converted here (convert them on "
                                    "your stream, e.g. rows.float(), and pass that stream)")
                                       .c_str());
            std::int64_t expect = 1;  // strides in elements, last dimension first
            for (std::size_t i = rows.ndim(); i-- > 0;) {
              if (rows.shape(i) != 1 && rows.stride(i) != expect)
                throw nb::value_error(
                    "CUDA rows must be C-contiguous: device arrays are not copied here (use "
                    "rows.contiguous() on your stream, and pass that stream)");
              expect *= static_cast<std::int64_t>(rows.shape(i));
            }
            const auto* data = static_cast<const float*>(rows.data());
            nb::gil_scoped_release release;
            return t.publish_device(data, n, stream);
          },
          "rows"_a, nb::kw_only(), "stream"_a = 0,
          "Publish rows (n, width) already on this card: a DLPack CUDA array, float32 and\n"
          "C-contiguous (others raise TypeError/ValueError: device arrays are never converted).\n"
          "`stream` is the cudaStream_t (an int, e.g. torch.cuda.current_stream().cuda_stream;\n"
          "default 0, the legacy default stream) of the work that wrote the rows: the kernel\n"
          "runs after the work queued on it so far, and later work on it runs after the kernel\n"
          "has read the rows. Until then the rows must stay allocated and unchanged: call\n"
          "synchronize() before freeing or rewriting them, unless only work on `stream` does\n"
          "that (e.g. dropping a PyTorch tensor allocated on `stream`: torch reuses its memory\n"
          "in that stream's order). Asynchronous; returns the first index.")
      .def(
          "publish",
          [](DeviceTable& t, HostRows rows) {
            const std::uint64_t n = row_count(rows, t.width());
            nb::gil_scoped_release release;
            return t.publish_host(rows.data(), n);
          },
          "rows"_a,
          "Publish rows (n, width) from host memory (converted to float32 if need be). They\n"
          "have been copied when this returns (it waits for the copy), so the buffer may be\n"
          "reused, pinned or not; the kernel is asynchronous. Returns the first index.")
      .def("host_count", &DeviceTable::host_count,
           "The host-visible count (acquire load of mapped memory).")
      .def(
          "host_snapshot",
          [](nb::handle self) {
            DeviceTable& t = nb::cast<DeviceTable&>(self);
            if (t.host_mirror() == nullptr) throw nb::value_error("no host mirror");
            const std::uint64_t n = t.host_count();
            return RowsView(t.host_mirror(), {static_cast<std::size_t>(n), t.width()}, self);
          },
          "The mirror's rows below host_count(), a read-only view (keeps the table alive).")
      .def("device_count", &DeviceTable::device_count, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "rows",
          [](DeviceTable& t, std::uint64_t first, std::optional<std::uint64_t> count) {
            const std::uint64_t n = resolve_count(count, t.count(), first);
            RowsCopy out = empty_rows(n, t.width());
            nb::gil_scoped_release release;
            t.copy_rows(out.data(), first, n);
            return out;
          },
          "first"_a = 0, "count"_a = nb::none(),
          "A host copy of published device rows (default: all from `first`); synchronizes.")
      .def("synchronize", &DeviceTable::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "watch_mirror",
          [](DeviceTable& t, std::uint64_t until, double timeout_s) {
            if (!std::isfinite(timeout_s) || timeout_s < 0.0)  // a clock duration from inf: UB
              throw nb::value_error("timeout_s must be finite and >= 0");
            std::vector<std::uint64_t> r;
            {
              nb::gil_scoped_release release;
              r = t.watch_mirror(until, timeout_s);
            }
            nb::dict out;
            out["polls"] = r[0];
            out["distinct_counts"] = r[1];
            out["bad_rows"] = r[2];
            out["last_count"] = r[3];
            return out;
          },
          "until"_a, "timeout_s"_a = 10.0,
          "Spin on the host flag until it reaches `until`, checking each newly visible\n"
          "mirror row (check rows, id = index). For the GPU checks.")
      .def("count", &DeviceTable::count,
           "Rows published through this object, including kernels still in flight.")
      .def("device", &DeviceTable::device)
      .def("width", &DeviceTable::width)
      .def("capacity", &DeviceTable::capacity)
      .def("stream_handle", &DeviceTable::stream_handle,
           "The cudaStream_t publications run on, as an int (for torch.cuda.ExternalStream).")
      .def("rows_pointer", &DeviceTable::rows_pointer, "Device address of row 0.");

  nb::class_<ReplicaSet>(
      m, "ReplicaSet",
      "One replica of a table per listed card (replica 0 is the source). broadcast copies\n"
      "new rows to every replica (peer copies, else staged through pinned host memory) and\n"
      "stores each replica's count on its reader stream after its rows' copy event.")
      .def(
          "__init__",
          [](ReplicaSet* self, std::uint32_t width, std::uint64_t capacity,
             std::optional<std::vector<int>> devices, bool allow_peer, std::uint64_t staging_rows) {
            std::vector<int> list;
            if (devices) {
              list = *devices;
            } else {
              const int count = tiercache::cuda::device_count();
              for (int d = 0; d < (count > 0 ? count : 1); ++d) list.push_back(d);
            }
            new (self) ReplicaSet(list, width, capacity, allow_peer, staging_rows);
          },
          "width"_a, "capacity"_a, "devices"_a = nb::none(), "allow_peer"_a = true,
          "staging_rows"_a = 4096,
          "`devices`: card per replica (default: every card); a card may repeat.\n"
          "`allow_peer=False` forces the staging path for every replica but the source.")
      .def(
          "broadcast",
          [](ReplicaSet& s, HostRows rows) {
            const std::uint64_t n = row_count(rows, s.width());
            nb::gil_scoped_release release;
            return s.broadcast_host(rows.data(), n);
          },
          "rows"_a,
          "Upload rows to replica 0 (done when this returns: it waits for the upload, so the\n"
          "buffer may be reused, pinned or not) and replicate them to every other replica\n"
          "(asynchronous). Returns the first index. If a broadcast fails partway, the set\n"
          "refuses every later one (CudaError): its count may be published on some replicas.")
      .def("broadcast_range", &ReplicaSet::broadcast_range, "first"_a, "count"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Replicate rows [first, first + count) already in replica 0 (written on work that\n"
           "has completed) and publish their count; `first` must equal count(). Refused, as\n"
          "broadcast, after a broadcast that failed partway.")
      .def("count", &ReplicaSet::count, "Rows fully broadcast so far.")
      .def("width", &ReplicaSet::width)
      .def("capacity", &ReplicaSet::capacity)
      .def("__len__", &ReplicaSet::replicas)
      .def("paths", &ReplicaSet::paths, "Per replica: source, peer, same-card or staging.")
      .def("replica_count", &ReplicaSet::replica_count, "replica"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "The count in a replica's memory, read on its reader stream.")
      .def(
          "rows",
          [](ReplicaSet& s, std::size_t replica, std::uint64_t first,
             std::optional<std::uint64_t> count) {
            const std::uint64_t n = resolve_count(count, s.count(), first);
            RowsCopy out = empty_rows(n, s.width());
            nb::gil_scoped_release release;
            s.copy_rows(replica, out.data(), first, n);
            return out;
          },
          "replica"_a, "first"_a = 0, "count"_a = nb::none(),
          "A host copy of a replica's rows, read on its reader stream.")
      .def("launch_reader_checks", &ReplicaSet::launch_reader_checks,
           "On every reader stream: read the count, check every row below it (asynchronous).")
      .def(
          "reader_report",
          [](ReplicaSet& s) {
            std::vector<std::vector<std::uint64_t>> r;
            {
              nb::gil_scoped_release release;
              r = s.reader_report();
            }
            nb::list out;
            for (const auto& row : r) {
              nb::dict d;
              d["checks"] = row[0];
              d["bad_rows"] = row[1];
              d["max_count"] = row[2];
              out.append(d);
            }
            return out;
          },
          "Per replica: reader checks run, bad rows they saw, the largest count they read.")
      .def("synchronize", &ReplicaSet::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("reader_stream_handle", &ReplicaSet::reader_stream_handle, "replica"_a)
      .def("published_event_handle", &ReplicaSet::published_event_handle, "replica"_a)
      .def("rows_pointer", &ReplicaSet::rows_pointer, "replica"_a)
      .def("count_pointer", &ReplicaSet::count_pointer, "replica"_a);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "tiercache's native library: a shared-memory row table and its CUDA replicas.";
  m.attr("LAYOUT_VERSION") = tiercache::kTableLayoutVersion;
  m.def("lock_clock", &tiercache::SharedTable::lock_clock,
        "The clock a publish's lock timeout runs on: 'monotonic' (a step of the wall clock "
        "neither ends nor stretches the wait) or 'realtime' (C libraries without "
        "pthread_mutex_clocklock).");

  nb::exception<tiercache::TableFormatError>(m, "TableFormatError", PyExc_ValueError);
  nb::exception<tiercache::TableFullError>(m, "TableFullError", PyExc_RuntimeError);
  nb::exception<tiercache::TableRetiredError>(m, "TableRetiredError", PyExc_RuntimeError);
  nb::exception<tiercache::cuda::CudaUnavailableError>(m, "CudaUnavailableError",
                                                       PyExc_RuntimeError);
  nb::exception<tiercache::cuda::CudaError>(m, "CudaError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tiercache::LockTimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  m.def("fence", &tiercache::fence,
        "A full (sequentially consistent) memory fence, for callers ordering their own data.");
  bind_table(m);
  bind_testing(m);
  bind_cuda(m);
}
