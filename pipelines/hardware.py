"""What this machine offers training: its CPU budget, native bf16, and what ``auto`` resolves to.

Everything here is decided from capabilities as torch and oneDNN see them, never from a timing
probe, so the same machine and environment always resolve the same way:

* **CPU budget**: the cores this process may use: the affinity mask, capped by a cgroup CPU quota
  (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` in v1), as ``docker --cpus`` sets it. Each of a node's
  training processes gets an equal share of it in torch threads, or ``PIPELINES_THREADS`` where set: for
  runs that share the cores with others the budget cannot see (two experiments of a ``dvc queue start -j 2``
  sweep), where threads beyond the cores only wait for each other.
* **Native bf16 on the CPU**: oneDNN has bf16 kernels of its own for ``avx512_core_bf16``,
  ``avx512_core_amx`` and ``avx2_vnni_2``; everywhere else (AVX2, and AVX-512 without BF16:
  Skylake-SP, Cascade Lake, Ice Lake) bf16 is emulated. A hold of the ISA
  (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``) is honoured, so a machine held to AVX2 resolves
  as an AVX2 machine does.
* **Precision** ``auto``: bf16 where it is native (those CPUs, a CUDA device of compute
  capability 8.0 or newer), fp32 elsewhere. **channels_last** ``auto``: on with bf16 or fp16, on
  GPUs and on AVX-512 CPUs, off for fp32 on AVX2 CPUs, where it measured slower (see
  ``benchmarks/precision.py``).
"""

from __future__ import annotations

import math
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# Measured slowdowns of bf16 against fp32 where bf16 is emulated: one fcos_small training step
# (benchmarks/precision.py, and docs/hardware.md for the machines).
EMULATED_BF16_SLOWDOWN = "18x slower than fp32 on an AVX2 CPU, 2.1x on AVX-512 without BF16"

# oneDNN's ONEDNN_MAX_CPU_ISA values that allow each of its native-bf16 ISAs (its ISA hierarchy:
# a cap allows every ISA whose instructions it includes). Unset, ALL or DEFAULT allow everything.
_ALLOWS = {
    "avx512_core_bf16": {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                         "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                         "AVX10_2_512_AMX_2"},
    "avx512_core_amx": {"AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16",
                        "AVX10_2_512_AMX_2"},
    "avx2_vnni_2": {"AVX2_VNNI_2", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
                    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"},
}
# What the CPU must have for each (torch.cpu.get_capabilities() names), and the ATen level it runs at.
_NEEDS = {"avx512_core_bf16": (("avx512_bf16",), "AVX512"),
          "avx512_core_amx": (("amx_bf16", "amx_tile"), "AVX512"),
          "avx2_vnni_2": (("avx_ne_convert", "avx_vnni"), "AVX2")}
_ATEN_LEVELS = ("DEFAULT", "AVX2", "AVX512")


@dataclass(frozen=True)
class Compute:
    """How the model computes: autocast ``precision`` (bf16 | fp16 | fp32) and the ``channels_last``
    memory layout; ``reason`` says why in one line, ``warning`` is set where bf16 is emulated."""

    precision: str
    channels_last: bool
    reason: str
    warning: str | None = None

    def as_params(self) -> dict[str, str | bool]:
        """The resolved choice as MLflow params and fingerprint entries (``compute.precision``, ...)."""
        return {"compute.precision": self.precision, "compute.channels_last": self.channels_last}

    def stored(self) -> dict[str, str | bool]:
        """What a model file keeps of it, so that evaluation computes as training did."""
        return {"precision": self.precision, "channels_last": self.channels_last}

    def describe(self) -> str:
        return f"precision {self.precision}, channels_last {'on' if self.channels_last else 'off'}: {self.reason}"

    def announce(self, logger: logging.Logger) -> None:
        """The stage's first line: what was chosen and why; then the warning, if any."""
        logger.info("%s", self.describe())
        if self.warning:
            logger.warning("%s", self.warning)


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> float | None:
    """The cgroup CPU quota of this process in CPUs (``docker --cpus=2``: 2.0), or ``None`` without one.

    Reads cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of this
    process's cgroup (``proc``, under the hierarchy mounted at ``root``) and of every cgroup above it:
    the smallest quota applies."""
    quotas = []
    for folder, v2 in _cgroup_folders(root, proc):
        try:
            if v2:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            else:
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
        except (OSError, ValueError):
            continue
        if quota not in ("max", "-1") and float(period) > 0:
            quotas.append(float(quota) / float(period))
    return min(quotas) if quotas else None


def _cgroup_folders(root: Path, proc: Path) -> list[tuple[Path, bool]]:
    """``(folder, is_v2)`` of this process's CPU cgroup and its ancestors, innermost first."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, v2 = root, True
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if base is None:
                continue
            v2 = False
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            if folder.is_dir():
                found.append((folder, v2))
    return found


def cpu_budget() -> int:
    """Cores this process may use: its affinity mask, capped by the cgroup quota (rounded down, at least 1)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(allowed, math.floor(quota)) if quota is not None else allowed)


THREADS_ENV = "PIPELINES_THREADS"


def threads_per_process(processes: int) -> int:
    """Torch threads for each of ``processes`` CPU processes on this node: ``PIPELINES_THREADS`` where set,
    else the CPU budget shared between them, at least 1."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return max(1, cpu_budget() // processes)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{THREADS_ENV}={value!r} in the environment: expected a whole number of threads, at least 1")
    return int(value)


def onednn_max_isa() -> str | None:
    """The oneDNN ISA cap set in the environment (``ONEDNN_MAX_CPU_ISA``, or the older ``DNNL_MAX_CPU_ISA``)."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return value.strip().upper() if value and value.strip().upper() not in ("ALL", "DEFAULT") else None


def native_bf16_cpu() -> str | None:
    """The oneDNN ISA that gives this CPU native bf16 (``avx512_core_amx``, ``avx512_core_bf16`` or
    ``avx2_vnni_2``) as torch and oneDNN will run it under any hold; ``None`` where bf16 is emulated."""
    flags = torch.cpu.get_capabilities()
    if flags.get("architecture") != "x86_64":
        return None
    aten = torch.backends.cpu.get_cpu_capability()
    level = _ATEN_LEVELS.index(aten) if aten in _ATEN_LEVELS else 0
    cap = onednn_max_isa()
    for isa in ("avx512_core_amx", "avx512_core_bf16", "avx2_vnni_2"):
        needs, aten_needed = _NEEDS[isa]
        if (all(flags.get(f) for f in needs) and level >= _ATEN_LEVELS.index(aten_needed)
                and (cap is None or cap in _ALLOWS[isa])):
            return isa
    return None


def cpu_isa() -> str:
    """The instruction set torch runs at here: ATen's level and any oneDNN cap (``AVX2, oneDNN held to AVX2``)."""
    cap = onednn_max_isa()
    return torch.backends.cpu.get_cpu_capability() + (f", oneDNN held to {cap}" if cap else "")


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and a phrase that says what decided it."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} has native bf16"
        return False, f"{name} has no native bf16 (compute capability below 8.0)"
    isa = native_bf16_cpu()
    if isa:
        return True, f"native bf16 on this CPU: {isa} as oneDNN counts it, ATen at {cpu_isa()}"
    return False, (f"no native bf16 on this CPU (ATen at {cpu_isa()}; no AVX512_BF16, AMX or AVX2_VNNI_2 as "
                   "oneDNN counts them)")


def resolve(precision: str, channels_last: bool | str, device: torch.device, *,
            source: str = "set in model.precision") -> Compute:
    """Resolve ``model.precision`` and ``model.channels_last`` (each may be ``auto``) for ``device``.

    ``auto`` precision is bf16 where it is native, fp32 elsewhere; ``auto`` channels_last is on for
    bf16 or fp16, on GPUs and for fp32 on AVX-512 CPUs, off for fp32 below AVX-512 (AVX2), where it
    measured slower. An explicit value is kept (``source`` says
    where it comes from); explicit bf16 where it is emulated gets a ``warning`` naming the measured
    slowdown.
    """
    native, hardware = bf16_support(device)
    if precision == "auto":
        chosen, reason = ("bf16" if native else "fp32"), f"auto: {hardware}"
    else:
        chosen, reason = precision, f"{source}; {hardware}"
    if channels_last == "auto":  # measured in benchmarks/precision.py, docs/hardware.md
        layout = device.type == "cuda" or chosen != "fp32" or torch.backends.cpu.get_cpu_capability() == "AVX512"
    else:
        layout = bool(channels_last)
    warning = None
    if chosen == "bf16" and not native:
        warning = (f"model.precision bf16: bf16 is emulated here ({hardware}); it measured "
                   f"{EMULATED_BF16_SLOWDOWN}: set model.precision to auto or fp32")
    return Compute(chosen, layout, reason, warning)
