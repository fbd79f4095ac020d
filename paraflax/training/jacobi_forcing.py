"""Jacobi Forcing data: the progressive noise schedule (paper Eq. 7), the choice of a noisy
point on each block's Jacobi trajectory, and the packed training sequence
[prompt, noisy_1, clean_1, noisy_2, clean_2, ...] whose noisy/clean pairs share positions.
The attention mask for it is `masks.noise_aware`. Host-side numpy (data pipeline)."""

from __future__ import annotations

import dataclasses

import numpy as np

from paraflax.masks import CLEAN, NOISY, PROMPT


def noise_schedule(num_blocks: int, window: int) -> np.ndarray:
  """t_i = W[i mod w] with W = {0, 1/w, ..., (w-1)/w}: noise fractions [num_blocks]."""
  if window < 1:
    raise ValueError(f"noise window must be >= 1, got {window}")
  return (np.arange(num_blocks) % window) / window


def pick_noisy(trajectory_TxN: np.ndarray, fixed_point_N: np.ndarray, t: float) -> np.ndarray:
  """The trajectory state whose fraction of unconverged tokens is nearest t (first on ties)."""
  unconverged = np.mean(trajectory_TxN != fixed_point_N[None], axis=1)  # [T]
  return trajectory_TxN[int(np.argmin(np.abs(unconverged - t)))]


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [P + 2*N*n] int32
  positions: np.ndarray  # [P + 2*N*n]: a noisy block and its clean twin share positions
  kinds: np.ndarray  # [P + 2*N*n]: masks.PROMPT / NOISY / CLEAN
  blocks: np.ndarray  # [P + 2*N*n]: block index (-1 in the prompt)


def pack(prompt: np.ndarray, noisy_NxN: np.ndarray, clean_NxN: np.ndarray) -> Packed:
  """Interleave noisy and clean blocks after the prompt."""
  if noisy_NxN.shape != clean_NxN.shape or noisy_NxN.ndim != 2:
    raise ValueError(f"noisy and clean blocks must both be [num_blocks, block_size], got "
                     f"{noisy_NxN.shape} and {clean_NxN.shape}")
  p = len(prompt)
  nb, n = clean_NxN.shape
  pos = p + np.arange(nb * n).reshape(nb, n)
  pair = lambda a, b: np.stack([a, b], 1).reshape(-1)  # [N, 2, n] -> flat
  return Packed(
      tokens=np.concatenate([prompt, pair(noisy_NxN, clean_NxN)]).astype(np.int32),
      positions=np.concatenate([np.arange(p), pair(pos, pos)]).astype(np.int32),
      kinds=np.concatenate([np.full(p, PROMPT), pair(np.full((nb, n), NOISY),
                                                     np.full((nb, n), CLEAN))]).astype(np.int32),
      blocks=np.concatenate([np.full(p, -1), pair(*[np.repeat(np.arange(nb)[:, None], n, 1)] * 2)
                             ]).astype(np.int32))
