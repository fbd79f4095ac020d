"""The weight-read floor of a decode step: memory bandwidth of the device kinds perf knows.

FLOPs and MFU of training steps come from `paraflax.training.flops` (one count for the trainer's
log and for `perf train`)."""

from __future__ import annotations

# (substring of `device_kind`, memory bandwidth bytes/s): spec-sheet figures, the first matching
# entry wins (so "H100 PCIe" before "H100", which is the SXM part)
BANDWIDTHS = (("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H200", 4.8e12))


def bandwidth(device_kind: str) -> float | None:
  """Memory bandwidth (bytes/s) of `device_kind`; None when perf does not know it."""
  return next((bw for name, bw in BANDWIDTHS if name in device_kind), None)


def floor_ms(weight_bytes: int, device_kind: str) -> float | None:
  """Milliseconds to read `weight_bytes` once at the device's bandwidth: the least a decode
  step (every weight read once) can take (None: unknown bandwidth)."""
  bw = bandwidth(device_kind)
  return None if bw is None else 1e3 * weight_bytes / bw
