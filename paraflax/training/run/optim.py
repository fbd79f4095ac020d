"""optax AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import jax
import optax

from paraflax.training.config.train import OptimConfig
from paraflax.training.run import layout


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Learning rate of update `count` (0-based): linear warmup to `peak_lr` at update
  `warmup_steps`, then cosine to `end_lr_fraction * peak_lr` at update `total_steps`.

  Shifted by one so the first update already moves (optax's warmup starts at lr 0).
  """
  warmup = min(cfg.warmup_steps, total_steps)
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.peak_lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=cfg.peak_lr * cfg.end_lr_fraction)
  return lambda count: base(count + 1)


def _decay_mask(params):
  """Matrices (and biases) decay; norm scales do not: by rank in one layer, so a stacked
  state (`layout.py`) decays the same leaves as a per-layer one."""
  return jax.tree.map(lambda n: n >= 2, layout.layer_ndim(params))


def optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """The full update rule; its step count lives in the optimizer state (checkpointed)."""
  adamw = optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.grad_clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
