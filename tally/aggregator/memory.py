"""The aggregator's allocator settings: freed memory goes back where the next request finds it.

glibc gives each thread that allocates its own malloc arena (up to 8 per core). gRPC reads
requests on its own threads and the engine runs on executor threads, so the buffers of a burst of
large messages end up spread over many arenas, each of which keeps its freed memory cached: after
80 refused 4 MiB messages the aggregator stayed ~65-75 MB above its starting size, against ~17 MB
with two arenas (bench/stream_memory.py). Two arenas keep allocation contention low for a process
whose CPU work holds the GIL anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas (call before the process starts its threads); False where the C library
    is not glibc or refuses, and nothing changes."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_ARENA_MAX, arenas))
