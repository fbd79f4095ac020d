"""Run control: how a run computes the model, apart from what the model is (`ModelConfig`).

None of it changes what the model computes beyond float rounding: a run may resume with other
values, Hugging Face configs neither read nor write it, and "auto" picks per device and
shape. A training config keeps it as `TrainConfig.run` (`--set run.remat=full`); a model
carries it as `Transformer(cfg, run=...)`. Decode-loop settings join here as the loop gains
them.

  attention    how attention is computed: "auto" or a kernel of `attention.IMPLEMENTATIONS`
               (`attention.resolve`).
  remat        what a layer keeps for the backward pass (only under differentiation): "none"
               every activation, "full" only its input (the rest is recomputed),
               "save_matmuls" also the outputs of the weight matmuls (projections, MLP;
               attention scores and elementwise ops are recomputed); "auto": on an
               accelerator, training (`train`, `--dry-run`, `perf`) takes the least recompute
               whose step fits the device by XLA's memory analysis (`training/run/fit.py`);
               otherwise (`remat_policy`) "full" when a row's activations exceed
               `REMAT_BUDGET` (every real-size model), else "none" (the demo and test models).
  remat_layers how many layers `remat` applies to, the first ones (`layer_remat`); the others
               keep every activation (None: all). The memory fit sets it when no remat does
               not fit and remat "full" on every layer is more than the step needs
               (`fit.py`). Layers that differ run unscanned.
  scan_layers  True runs the layers as one `lax.scan` over their weights stacked at call
               time (the parameter tree keeps one entry per layer): one compiled layer, and a
               backward pass that recomputes one layer at a time, which XLA's CPU scheduler
               only honours inside a loop. Each forward copies the stacked weights, which a
               decode step would pay every token: "auto" (`scans`) scans the cache-free calls
               (training, validation) of a model whose remat resolves to a policy, never a
               call over a cache (decoding).
  platform     the platform "auto" resolves for: "cpu", "gpu" or "tpu"; None (the default)
               the process's own backend (`backend`). A program compiled for another
               target (`paraflax perf compile`) names the target's platform here, so every
               choice ("auto" attention, steps per decode iteration) is the target's.
  loss_chunk   positions of a row the training losses project through the output head at
               once (`training/objectives/head_loss.py`): None ("auto") the whole row while its
               float32 logits stay small, chunks that keep them so otherwise (on an
               accelerator, the whole row first when the step then fits: `fit.py`); an int
               forces chunks of that many positions (>= the row: the whole row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paraflax.model.attention import IMPLEMENTATIONS, resolve
from paraflax.model.config import ModelConfig

# `remat` -> what `jax.checkpoint` saves of a layer (None: no checkpoint; dots without batch
# dims are the weight matmuls: attention's score and value products have batch dims)
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
REMAT = ("auto", *REMAT_POLICIES)
PLATFORMS = (None, "cpu", "gpu", "tpu")
# "auto" remat: rematerialise when a backward pass would keep more than this per row
REMAT_BUDGET = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class RunControl:
  """How a run computes the model (module docstring); frozen, hashable."""

  attention: str = "auto"
  remat: str = "auto"
  scan_layers: bool | str = "auto"  # True | False | "auto"
  loss_chunk: int | None = None  # None: auto
  platform: str | None = None  # None: the process's default backend
  remat_layers: int | None = None  # None: every layer

  def __post_init__(self):
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"run.attention must be one of {', '.join(IMPLEMENTATIONS)}; got "
                       f"{self.attention!r}")
    if self.remat not in REMAT:
      raise ValueError(f"run.remat must be one of {list(REMAT)}, got {self.remat!r}")
    if not (isinstance(self.scan_layers, bool) or self.scan_layers == "auto"):
      raise ValueError(f"run.scan_layers must be True, False or 'auto', got "
                       f"{self.scan_layers!r}")
    if self.platform not in PLATFORMS:
      raise ValueError(f"run.platform must be one of {PLATFORMS}, got {self.platform!r}")
    if self.loss_chunk is not None and (isinstance(self.loss_chunk, bool)
                                        or not isinstance(self.loss_chunk, int)
                                        or self.loss_chunk < 1):
      raise ValueError(f"run.loss_chunk must be an int >= 1 or None (auto), "
                       f"got {self.loss_chunk!r}")
    if self.remat_layers is not None and (isinstance(self.remat_layers, bool)
                                          or not isinstance(self.remat_layers, int)
                                          or self.remat_layers < 1):
      raise ValueError(f"run.remat_layers must be an int >= 1 or None (every layer), "
                       f"got {self.remat_layers!r}")

  def backend(self) -> str:
    """The platform the run control resolves for: `platform`, else the default backend."""
    return self.platform or jax.default_backend()

  def remat_policy(self, cfg: ModelConfig) -> str:
    """`remat` with "auto" resolved for `cfg`: "full" when the activations an
    un-rematerialised backward keeps for one row at `max_seq_len` (about 4 d_model + 3 d_ff
    values per token and layer) exceed `REMAT_BUDGET` (0.9 GiB for Qwen2.5-0.5B at 1024
    tokens), else "none"."""
    if self.remat != "auto":
      return self.remat
    per_token = (4 * cfg.d_model + 3 * cfg.d_ff) * jnp.dtype(cfg.compute_dtype).itemsize
    return "full" if cfg.n_layers * cfg.max_seq_len * per_token > REMAT_BUDGET else "none"

  def layer_remat(self, cfg: ModelConfig, i: int) -> str:
    """The resolved remat of layer `i`: `remat_policy`'s for the first `remat_layers`, "none"
    after them."""
    return ("none" if self.remat_layers is not None and i >= self.remat_layers
            else self.remat_policy(cfg))

  def partial(self, cfg: ModelConfig) -> bool:
    """Whether the layers' remat differs between them (`remat_layers` below the layers)."""
    return (self.remat_layers is not None and self.remat_layers < cfg.n_layers
            and self.remat_policy(cfg) != "none")

  def attention_for(self, cfg: ModelConfig, rows: int, cached: bool = False) -> str:
    """The attention `attention` resolves to for a call of `cfg`'s model with `rows` query
    rows (over a cache when `cached`) on `backend()`; "kernel|fallback" where it falls back
    for shapes a kernel declines."""
    impl = resolve(self.attention, self.backend(), cfg.dtype, max_len=cfg.max_seq_len,
                   rows=rows, cached=cached)
    return impl if isinstance(impl, str) else "|".join(impl)

  def resolved(self, cfg: ModelConfig, rows: int) -> dict:
    """This run control with "auto" resolved for a training call of `cfg`'s model on rows of
    `rows` tokens, and the platform it resolved for (what a workdir records)."""
    partial = {"remat_layers": self.remat_layers} if self.partial(cfg) else {}
    return {"attention": self.attention_for(cfg, rows), "remat": self.remat_policy(cfg),
            **partial, "scan_layers": self.scans(cfg, cached=False), "platform": self.backend()}

  def scans(self, cfg: ModelConfig, cached: bool) -> bool:
    """`scan_layers` with "auto" resolved for one call of `cfg`'s model: scan a cache-free
    call when remat applies to every layer, never a call over a cache."""
    if self.scan_layers != "auto":
      return self.scan_layers
    return not cached and self.remat_policy(cfg) != "none" and not self.partial(cfg)


FIELDS = tuple(f.name for f in dataclasses.fields(RunControl))
