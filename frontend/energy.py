"""The energy counters of the host the frontend runs on, for GET /energy_metrics (the seed's route):
RAPL packages under /sys/class/powercap (Intel, and AMD through the same driver) and NVIDIA GPUs
through NVML (libnvidia-ml, the driver's own library, loaded with ctypes: no Python binding to
install). Each counter is the energy used since it started counting (boot, or the driver's load):
a client takes two readings and divides the difference by the time between them.

A host with neither (a VM, a container without the powercap files, a GPU-less machine) has
nothing to report: `read_energy` says why, and the route answers 404 with that reason.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
NVML_LIBRARY = "libnvidia-ml.so.1"


@dataclass(frozen=True, slots=True)
class EnergyReading:
    source: str  # "rapl" or "nvml"
    zone: str  # the RAPL package ("package-0") or the GPU ("gpu-0")
    energy_j: float


def rapl_readings(root: Path = POWERCAP) -> tuple[list[EnergyReading], str]:
    """One reading per top-level RAPL zone (a package: its cores, caches and uncore; its sub-zones
    are parts of it and not added again), or none and why."""
    if not root.is_dir():
        return [], f"{root} does not exist (no RAPL driver, or not exposed to this host)"
    readings, unreadable = [], []
    for zone in sorted(root.glob("*-rapl:*")):
        if zone.name.count(":") != 1:
            continue  # a sub-zone (core, uncore, dram) of a package
        try:
            microjoules = int((zone / "energy_uj").read_text())
            name = (zone / "name").read_text().strip() if (zone / "name").exists() else zone.name
        except (OSError, ValueError) as e:
            unreadable.append(
                f"{zone / 'energy_uj'}: {e.strerror if isinstance(e, OSError) else e}"
            )
            continue
        readings.append(EnergyReading("rapl", name, microjoules / 1e6))
    if readings:
        return readings, ""
    if unreadable:
        return [], "RAPL counters are not readable: " + "; ".join(unreadable)
    return [], f"{root} has no RAPL zone"


def nvml_readings(library: str = NVML_LIBRARY) -> tuple[list[EnergyReading], str]:
    """Each NVIDIA GPU's energy since the driver loaded (Volta and later), or none and why."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return [], f"{library} is not present (no NVIDIA driver)"
    if nvml.nvmlInit_v2() != 0:
        return [], "NVML did not initialize"
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return [], "NVML finds no GPU"
        readings = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            millijoules = ctypes.c_ulonglong(0)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) != 0:
                continue  # older than Volta: no energy counter
            readings.append(EnergyReading("nvml", f"gpu-{index}", millijoules.value / 1e3))
        return readings, "" if readings else "no GPU here has an energy counter (Volta or later)"
    finally:
        nvml.nvmlShutdown()


def read_energy() -> tuple[list[EnergyReading], str]:
    """Every counter this host has, or none and the reasons each source gave."""
    rapl, rapl_why = rapl_readings()
    gpus, nvml_why = nvml_readings()
    readings = rapl + gpus
    return readings, "" if readings else f"{rapl_why}; {nvml_why}"
