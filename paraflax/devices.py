"""What paraflax knows of accelerators: bf16 dense peak FLOP/s and memory bandwidth per device
kind, spec-sheet figures, for MFU (`training/run/flops.py`) and the weight-read floor of a decode
step (`perf decode`).

Rows are matched by a substring of `jax.Device.device_kind`, the first match winning (so
"H100 PCIe" before "H100", the SXM part). NVIDIA H100 / H200 / A100 datasheets (sparsity
figures halved); Google Cloud TPU system-architecture pages (v4, v5e = "TPU v5 lite",
v5p = "TPU v5", v6e = "TPU v6 lite"). None: not known (the A100's bandwidth depends on its
memory, which its device kind does not always say).
"""

from __future__ import annotations

# (device_kind substring, peak bf16 FLOP/s, memory bandwidth bytes/s)
SPECS: tuple[tuple[str, float, float | None], ...] = (
    ("H100 PCIe", 756e12, 2.0e12), ("H100 NVL", 835e12, 3.9e12), ("H100", 989e12, 3.35e12),
    ("H200", 989e12, 4.8e12), ("A100", 312e12, None), ("TPU v4", 275e12, 1.2e12),
    ("TPU v5 lite", 197e12, 0.819e12), ("TPU v5e", 197e12, 0.819e12),
    ("TPU v5p", 459e12, 2.765e12), ("TPU v5", 459e12, 2.765e12),
    ("TPU v6 lite", 918e12, 1.64e12), ("TPU v6e", 918e12, 1.64e12))


def _kind(device_kind: str | None) -> str:
  if device_kind is None:
    import jax  # only when asked about this machine
    return jax.devices()[0].device_kind
  return device_kind


def _row(device_kind: str | None):
  kind = _kind(device_kind)
  return next((row for row in SPECS if row[0] in kind), (kind, None, None))


def peak_flops(device_kind: str | None = None) -> float | None:
  """bf16 dense peak FLOP/s of a device kind (default: the first JAX device's); None where it
  is not known (CPU, other accelerators)."""
  return _row(device_kind)[1]


def bandwidth(device_kind: str | None = None) -> float | None:
  """Memory bandwidth (bytes/s) of a device kind (default: the first JAX device's); None where
  it is not known."""
  return _row(device_kind)[2]


def floor_ms(weight_bytes: int, device_kind: str | None = None) -> float | None:
  """Milliseconds to read `weight_bytes` once at the device's bandwidth: the least a decode
  step (every weight read once) can take (None: unknown bandwidth)."""
  bw = bandwidth(device_kind)
  return None if bw is None else 1e3 * weight_bytes / bw
