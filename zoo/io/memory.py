"""How much memory a job may use: a size the user writes (``--max-memory 4GB``), the memory the machine has
available now, and the budget the streaming and calibration paths plan within."""
from __future__ import annotations

import re


def parse_bytes(text) -> int:
    """``"4GB"``, ``"512MiB"``, ``"2.5G"`` or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"memory size {text!r}: expected e.g. 4GB, 512MiB or a number of bytes")
    base = 1024 if m.group(3).startswith("i") else 1000
    return int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemTotal", 8 << 30))


def memory_budget(max_memory=None) -> int:
    """``max_memory`` in bytes; by default half of the memory available now."""
    return parse_bytes(max_memory) if max_memory is not None else available_memory() // 2
