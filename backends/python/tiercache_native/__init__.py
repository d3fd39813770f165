"""tiercache's native library: a shared-memory table of float32 rows, and its CUDA replicas.

`SharedTable` is the host side: an append-only table in a file mapping that every process on
the host opens by path; writers publish rows with release ordering under a robust
process-shared lock, readers take zero-copy snapshots without locks. `DeviceTable` and
`ReplicaSet` are the CUDA side (they raise `CudaUnavailableError` without a device). See
backends/README.md for the protocol, what is tested and how.
"""

from ._core import (
    LAYOUT_VERSION,
    CudaError,
    CudaUnavailableError,
    DeviceTable,
    ReplicaSet,
    SharedTable,
    TableFormatError,
    TableFullError,
    TableRetiredError,
    cuda_compiled,
    cuda_device_count,
    cuda_status,
    fence,
    lock_clock,
)

__all__ = [
    "LAYOUT_VERSION",
    "CudaError",
    "CudaUnavailableError",
    "DeviceTable",
    "ReplicaSet",
    "SharedTable",
    "TableFormatError",
    "TableFullError",
    "TableRetiredError",
    "cuda_compiled",
    "cuda_device_count",
    "cuda_status",
    "fence",
    "lock_clock",
]
