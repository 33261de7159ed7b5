"""The worker process's host memory, read from the kernel: what loading a model cost."""

from __future__ import annotations

import os
import resource


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def anon_rss_bytes() -> int:
    """Private (anonymous) resident memory: what loading really costs the host; the
    memory-mapped checkpoint pages it touches are page cache, shared and reclaimable."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
