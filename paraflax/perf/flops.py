"""FLOPs per training token, MFU and the weight-read floor of a decode step, against the
published peaks of the device kinds perf knows (others: None)."""

from __future__ import annotations

# (substring of `device_kind`, dense bf16 FLOP/s, memory bandwidth bytes/s): spec-sheet
# figures, the first matching entry wins (so "H100 PCIe" before "H100", which is the SXM part)
PEAKS = (("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12), ("H200", 989e12, 4.8e12),
         ("A100", 312e12, None))


def _peak(device_kind: str, i: int) -> float | None:
  return next((p[i] for p in PEAKS if p[0] in device_kind), None)


def peak_flops(device_kind: str) -> float | None:
  """Dense bf16 FLOP/s of `device_kind`; None when perf does not know it."""
  return _peak(device_kind, 1)


def bandwidth(device_kind: str) -> float | None:
  """Memory bandwidth (bytes/s) of `device_kind`; None when perf does not know it."""
  return _peak(device_kind, 2)


def train_flops_per_token(cfg, params: int, seq_len: int) -> int:
  """6 N + 6 L d T: N the parameters that multiply (the embedding lookup left out when the
  output projection is untied), plus causal attention's 6 L d T (PaLM's 12 L d T halved by the
  causal mask). It counts data tokens: objectives that run a row twice (TiDAR's doubled
  sequence) do more work than it counts."""
  n = params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
  return 6 * n + 6 * cfg.n_layers * cfg.d_model * seq_len


def mfu(flops_per_token: float, tokens_per_s: float, device_kind: str) -> float | None:
  """Model FLOPs utilisation: flops_per_token x tokens/s / the device's peak (None: unknown)."""
  peak = peak_flops(device_kind)
  return None if peak is None else flops_per_token * tokens_per_s / peak


def floor_ms(weight_bytes: int, device_kind: str) -> float | None:
  """Milliseconds to read `weight_bytes` once at the device's bandwidth: the least a decode
  step (every weight read once) can take (None: unknown bandwidth)."""
  bw = bandwidth(device_kind)
  return None if bw is None else 1e3 * weight_bytes / bw
