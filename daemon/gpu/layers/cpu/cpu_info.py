"""What /proc/cpuinfo says of this machine's CPU, torch-free (the pool's estimate reads it
as well as the layers): `cpuinfo_field(key)`, the first processor's value for `key`
("flags", "vendor_id", ...), read once per key; "" where the file or the key is missing
(not Linux, or a CPU that does not say)."""
from __future__ import annotations

import functools


@functools.cache
def cpuinfo_field(key: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()
