"""What /proc/cpuinfo says about this CPU: the package's one reader of it, for the dtype and kernel choices and the
machine kind recorded with every benchmark figure."""

from __future__ import annotations

import functools
from pathlib import Path


def processor_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields ("model name", "cpu family", "flags", ...) from ``cpuinfo`` (default:
    /proc/cpuinfo's text; empty where it cannot be read, as off Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags ("avx2", "avx512_bf16", "amx_tile", ...); empty where /proc/cpuinfo lists none."""
    return frozenset(processor_fields().get("flags", "").split())
