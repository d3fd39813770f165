"""Self-checking rows for tests and benchmarks.

A check row's values derive from its id and its last value is a checksum of the others and of
the id, computed by the same C++ code on the host and on the GPU. A torn row (part old, part
new) or a row read before its data landed (zeros) fails `bad_rows`.
"""

from ._core import count_bad_rows as bad_rows
from ._core import make_check_rows as make_rows

__all__ = ["bad_rows", "make_rows"]
