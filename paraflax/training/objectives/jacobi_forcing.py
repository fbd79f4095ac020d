"""Jacobi Forcing data: the progressive noise schedule (paper Eq. 7), the choice of a noisy
point on each block's Jacobi trajectory, and the packed training sequence: the prompt, then
the noisy stream [noisy_1, ..., noisy_N], then the clean stream [clean_1, ..., clean_N], a
noisy block and its clean twin at the same positions. The attention mask for it is
`masks.noise_aware`, passed structured (`mask_structure.noise_aware`; with the rows' prompt
region known, `prompt_len`, in the windows a kernel attends without the pairs between the
streams); the data side is host numpy + grain, the loss (`jacobi_forcing_loss`, objective
"jacobi_forcing") is a pure function."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from paraflax.data.source import TrainData, register_source
from paraflax.model import mask_structure
from paraflax.model.masks import CLEAN, NOISY, PROMPT
from paraflax.training.objectives.head_loss import pair_cross_entropy, token_nll
from paraflax.training.objectives.means import Loss, Mean
from paraflax.training.objectives.protocol import register_objective


def noise_schedule(num_blocks: int, window: int) -> np.ndarray:
  """t_i = W[i mod w] with W = {0, 1/w, ..., (w-1)/w}: noise fractions [num_blocks]."""
  if window < 1:
    raise ValueError(f"noise window must be >= 1, got {window}")
  return (np.arange(num_blocks) % window) / window


NOISE_MEASURES = ("unconverged", "suffix")


def pick_noisy(trajectory_TxN: np.ndarray, fixed_point_N: np.ndarray, t: float,
               measure: str = "unconverged") -> np.ndarray:
  """The trajectory state whose noise is nearest t (first on ties). Noise: the fraction of
  unconverged tokens ("unconverged", the paper's), or of the tokens from the first unconverged
  one on, (n - first divergence) / n ("suffix", the released data scripts')."""
  differs_TxN = trajectory_TxN != fixed_point_N[None]
  n = differs_TxN.shape[1]
  if measure == "suffix":
    noise = np.where(differs_TxN.any(1), n - differs_TxN.argmax(1), 0) / n  # [T]
  else:
    noise = differs_TxN.mean(1)  # [T]
  return trajectory_TxN[int(np.argmin(np.abs(noise - t)))]


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [P + 2*N*n] int32
  positions: np.ndarray  # [P + 2*N*n]: a noisy block and its clean twin share positions
  kinds: np.ndarray  # [P + 2*N*n]: masks.PROMPT / NOISY / CLEAN
  blocks: np.ndarray  # [P + 2*N*n]: block index (-1 in the prompt)


def pack(prompt: np.ndarray, noisy_NxN: np.ndarray, clean_NxN: np.ndarray) -> Packed:
  """The prompt, the noisy blocks, then the clean blocks (the two streams one after the other:
  `mask_structure.noise_aware` attends them apart)."""
  if noisy_NxN.shape != clean_NxN.shape or noisy_NxN.ndim != 2:
    raise ValueError(f"noisy and clean blocks must both be [num_blocks, block_size], got "
                     f"{noisy_NxN.shape} and {clean_NxN.shape}")
  p = len(prompt)
  nb, n = clean_NxN.shape
  pos, ids = p + np.arange(nb * n), np.repeat(np.arange(nb), n)
  return Packed(
      tokens=np.concatenate([prompt, noisy_NxN.reshape(-1),
                             clean_NxN.reshape(-1)]).astype(np.int32),
      positions=np.concatenate([np.arange(p), pos, pos]).astype(np.int32),
      kinds=np.concatenate([np.full(p, PROMPT), np.full(nb * n, NOISY),
                            np.full(nb * n, CLEAN)]).astype(np.int32),
      blocks=np.concatenate([np.full(p, -1), ids, ids]).astype(np.int32))


def example(prompt: np.ndarray, noisy_NxN: np.ndarray, clean_NxN: np.ndarray,
            length: int) -> dict[str, np.ndarray]:
  """One training row of `length` slots: the prompt, the noisy stream, padding up to the
  prompt region of `length - 2 N n` slots (a store's longest prompt) past the noisy stream,
  then the clean stream. Every row's clean stream starts at the same slot, and the prompt and
  the noisy stream, first, see exactly the slots before them: a kernel attends them under its
  causal mask (`mask_structure.noise_aware`). Keys (all [length]): tokens, positions, kinds,
  valid; ar_targets/ar_weights (next token of the clean stream, prompt included); partner
  (the clean twin of a noisy slot, else itself); kl_weights (noisy slots from the first token
  where the noisy block differs from its fixed point onward)."""
  packed = pack(prompt, noisy_NxN, clean_NxN)
  nb, n = clean_NxN.shape
  p, m = len(prompt), nb * n
  region = length - 2 * m  # the prompt region
  if region < p:
    raise ValueError(f"packed example has {len(packed.tokens)} tokens, more than the row "
                     f"length {length}")
  clean = region + m + np.arange(m)  # the clean stream's slots
  at = np.concatenate([np.arange(p + m), clean])  # the packed tokens' slots

  def place(values, fill=0):
    out = np.full(length, fill, values.dtype)
    out[at] = values
    return out

  tokens = place(packed.tokens)
  stream = np.concatenate([np.arange(p), clean])  # [prompt, clean stream]
  targets = np.zeros(length, np.int32)
  weights = np.zeros(length, np.float32)
  targets[stream[:-1]], weights[stream[:-1]] = tokens[stream[1:]], 1.0
  partner = np.arange(length, dtype=np.int32)
  partner[p:p + m] = clean
  differs = noisy_NxN != clean_NxN
  first = np.where(differs.any(1), differs.argmax(1), n)  # [N] first divergent slot
  kl = np.zeros(length, np.float32)
  kl[p:p + m] = (np.arange(n)[None] >= first[:, None]).reshape(-1)
  return {"tokens": tokens, "positions": place(packed.positions),
          "kinds": place(packed.kinds, PROMPT), "valid": place(np.ones(p + 2 * m, bool), False),
          "ar_targets": targets, "ar_weights": weights, "partner": partner, "kl_weights": kl}


DTYPES = {"tokens": np.int32, "positions": np.int32, "kinds": np.int32, "valid": np.bool_,
          "ar_targets": np.int32, "ar_weights": np.float32, "partner": np.int32,
          "kl_weights": np.float32}  # the `example` keys, each [length]
FIELDS = tuple(DTYPES)


@register_source("trajectories")
@dataclasses.dataclass(frozen=True)
class TrajectoryData:
  """The data source "trajectories": packed rows of a trajectory store (`paraflax
  collect-trajectories`), tokenized by the store's model's tokenizer.

  `noise_window` is Eq. 7's w. Each row draws a random phase o and gives block i the noise
  level W[(i + o) mod w], so every block index sees every level (Eq. 7 fixes o = 0).
  `noise_measure` (`pick_noisy`): "unconverged" is the paper's, on W = {0, 1/w, ..., (w-1)/w};
  "suffix" is the released data scripts' (n - first divergence) / n, on the grid shifted by
  1/w, {1/w, ..., 1}: fully noisy blocks in, fixed points (no consistency signal) out. The last
  `val_fraction` of the store's examples are held out for validation. `data.seq_len` must be
  the store's packed row length (`row_length`).
  """
  fields: ClassVar[tuple[str, ...]] = FIELDS
  path: str
  noise_window: int = 4
  noise_measure: str = "unconverged"
  val_fraction: float = 0.05

  def __post_init__(self):
    if self.noise_window < 1:
      raise ValueError(f"noise window must be >= 1, got {self.noise_window}")
    if self.noise_measure not in NOISE_MEASURES:
      raise ValueError(f"noise_measure must be one of {NOISE_MEASURES}, got "
                       f"{self.noise_measure!r}")
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

  def open(self, data, *, progress: bool = True) -> TrainData:
    """Batches of `data.batch_size` rows shuffled by `data.seed` (see `datasets`)."""
    del progress
    from paraflax.training.stores import store
    meta = store.read_meta(self.path, what="trajectory store", command="collect-trajectories")
    store.check_row_length(self.path, "trajectory store", row_length(meta),
                           "max_prompt_len + 2 x num_blocks x block_size", data.seq_len)
    it, val, meta = datasets(self, data.batch_size, data.seed)
    # a noisy block and its clean twin share positions
    top = meta["max_prompt_len"] + meta["num_blocks"] * meta["block_size"]
    return TrainData(it, val, store.load_tokenizer(self.path), max_position=top,
                     tokenizer_source=store.tokenizer_source(self.path, "trajectory"),
                     rows="trajectory")


  def objective_args(self, data) -> dict:
    """The objective arguments the store's rows fix: `prompt_len`, their prompt region (the
    store's max_prompt_len; `jacobi_forcing_loss`). Reads the store's meta alone."""
    del data
    from paraflax.training.stores import store
    meta = store.read_meta(self.path, what="trajectory store", command="collect-trajectories")
    return {"prompt_len": meta["max_prompt_len"]}

  def stand_in_args(self, data) -> dict:
    """What `train --dry-run` compiles with before the store exists: a prompt region of 0 (1
    for rows of odd length), two streams of half the row each."""
    return {"prompt_len": data.seq_len % 2}

  def shapes(self, data) -> dict:
    """{field: (shape, dtype)} of a batch: every field `[data.batch_size, data.seq_len]`."""
    return {k: ((data.batch_size, data.seq_len), np.dtype(t)) for k, t in DTYPES.items()}


def row_length(meta: dict) -> int:
  """Packed row length of a store: longest prompt + noisy and clean copies of every block."""
  return meta["max_prompt_len"] + 2 * meta["num_blocks"] * meta["block_size"]


def noise_levels(num_blocks: int, window: int, phase: int,
                 measure: str = "unconverged") -> np.ndarray:
  """Target noise of each block of a row [num_blocks]: W[(i + phase) mod w], on the grid of
  `measure` (see `TrajectoryData`)."""
  levels = noise_schedule(num_blocks + phase, window)[phase:]
  return levels + 1 / window if measure == "suffix" else levels


def _row(data, length: int, cfg: TrajectoryData, i: int, rng: np.random.Generator) -> dict:
  traj = data.trajectories[i]  # [N, n+1, n]
  m = cfg.noise_measure
  levels = noise_levels(len(traj), cfg.noise_window, int(rng.integers(cfg.noise_window)), m)
  noisy = np.stack([pick_noisy(t, t[-1], lvl, m) for t, lvl in zip(traj, levels)])
  return example(data.prompts[i, :data.prompt_lens[i]], noisy, traj[:, -1], length)


def _stack(rows):
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def datasets(cfg: TrajectoryData, batch_size: int, seed: int):
  """(train iterator (checkpointable, infinite, shuffled), validation batches, meta) of a
  trajectory store. Batches: the `example` keys, each [batch_size, row_length]."""
  import grain

  from paraflax.training.stores import trajectories
  data = trajectories.load(cfg.path)
  total = len(data.prompt_lens)
  n_val = max(1, round(total * cfg.val_fraction))
  if total - n_val < batch_size or n_val < batch_size:
    raise ValueError(f"trajectory store {cfg.path!r} has {total} examples: too few for a "
                     f"batch of {batch_size} in both splits "
                     f"(data_source_args.val_fraction={cfg.val_fraction})")
  length = row_length(data.meta)
  make = lambda i, rng: _row(data, length, cfg, int(i), rng)
  train = (grain.MapDataset.range(total - n_val).shuffle(seed=seed).repeat(None)
           .random_map(make, seed=seed).batch(batch_size, drop_remainder=True))
  it = iter(train.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  rng = np.random.default_rng(seed)
  val = [_row(data, length, cfg, i, rng) for i in range(total - n_val, total)]
  val = [_stack(val[j:j + batch_size]) for j in range(0, n_val - batch_size + 1, batch_size)]
  return it, val, data.meta


@register_objective("jacobi_forcing", fields=FIELDS, source="trajectories")
def jacobi_forcing_loss(model, batch, rng, ar_weight: float = 10.0, temperature: float = 1.0,
                        consistency: str = "soft", prompt_len: int | None = None):
  """Progressive consistency loss + `ar_weight` x AR loss on the clean stream.

  `prompt_len`: the rows' prompt region (a trajectory store's `max_prompt_len`; the trainer
  takes it from the store, `TrajectoryData.objective_args`; required). A kernel attends the
  prompt region and the noisy stream under its causal mask and the clean stream apart
  (`mask_structure.noise_aware`).

  Consistency, on `kl_weights` slots (from the first token where a noisy block departs from
  its fixed point):
    "soft": soft cross entropy of every noisy slot's logits against its clean twin's
      (stop-gradient) logits at `temperature`, times temperature^2 (the official code's
      choice, with the 10x AR weight);
    "hard": cross entropy against the fixed point's next token (the clean twin's label). The
      target is data, not the live model, so a tiny model cannot lower the loss by making
      both streams degenerate together (which "soft" does on the demo's 1.3M model).
  The head projects each slot once (`head_loss`): the prompt region's slots (AR targets), and
  each clean slot paired with its noisy twin (`pair_cross_entropy`; the twin's target is the
  clean slot's AR target). The clean slot's logits, detached, are the soft consistency's
  teacher, so no teacher row is projected.
  """
  del rng
  if consistency not in ("soft", "hard"):
    raise ValueError(f"consistency must be 'soft' or 'hard', got {consistency!r}")
  mask = mask_structure.noise_aware(batch["kinds"], batch["valid"], prompt_len)
  hidden_BxLxD, _ = model(batch["tokens"], batch["positions"], mask, hidden=True)
  p, s = prompt_len, _clean_start(batch["tokens"].shape[1], prompt_len)
  # the noisy stream starts where a row's prompt ends; its slot j is clean slot s + j's twin
  m = hidden_BxLxD.shape[1] - s
  noisy_BxM = jnp.argmax(batch["kinds"] == NOISY, 1)[:, None] + jnp.arange(m)
  twins = jnp.take_along_axis(hidden_BxLxD, noisy_BxM[..., None], 1)
  pairs_BxMx2xD = jnp.stack([hidden_BxLxD[:, s:], twins], 2)
  ar_t, ar_w = batch["ar_targets"], batch["ar_weights"]
  stats = pair_cross_entropy(model, pairs_BxMx2xD, ar_t[:, s:],
                             temperature if consistency == "soft" else None)
  nll_p, hit_p = token_nll(model, hidden_BxLxD[:, :p], ar_t[:, :p])
  nll, hit = stats["nll"], stats["hit"]  # [B, M, 2]: the clean slot's, its noisy twin's
  ar_w = jnp.concatenate([ar_w[:, :p], ar_w[:, s:]], 1)
  ar = Mean.of(jnp.concatenate([nll_p, nll[..., 0]], 1), ar_w)
  acc = Mean.of(jnp.concatenate([hit_p, hit[..., 0]], 1), ar_w)
  w = jnp.take_along_axis(batch["kl_weights"], noisy_BxM, 1)
  has_target = w * batch["ar_weights"][:, s:]  # the last slot of the last block has none
  loss_c = (Mean.of(nll[..., 1], has_target) if consistency == "hard"
            else Mean.of(stats["soft"], w))
  return Loss.of(loss_c, (ar_weight, ar)), {
      "ar_loss": ar, "consistency": loss_c, "accuracy": acc,
      "noisy_accuracy": Mean.of(hit[..., 1], has_target)}


def _clean_start(length: int, prompt_len: int | None) -> int:
  """The clean stream's first slot, P + M, of rows of `length` with prompt region
  `prompt_len` (`example`; `mask_structure.noise_aware` checks the two fit)."""
  if prompt_len is None:
    raise ValueError("jacobi_forcing needs objective_args.prompt_len, the rows' prompt region "
                     "(a trajectory store's max_prompt_len, which the trainer takes from the "
                     "store)")
  return (length + prompt_len) // 2
