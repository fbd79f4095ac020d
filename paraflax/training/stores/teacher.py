"""DEER teacher data: greedy continuations of training-split prompts by the AR model the drafter
will serve (the verifier), stored with tensorstore (`store.py`). DEER's two alignment stages
and the small-AR-drafter baseline all train on these rows (`deer.py`).

Every answer has exactly `answer_len` tokens (the teacher decodes with `eos_id=None`: past an
end of document it continues as the AR model would with no stop token).

A store is a directory (see `store.py`):
    meta.json, tokenizer.json, progress.json
    prompts/      zarr int32 [N, P] right-padded (P = max_prompt_len)   prompt_lens/ [N]
    answers/      zarr int32 [N, A] (A = answer_len)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from etils.epath import Path  # stores may live on gs://

from paraflax.parallel import sharding
from paraflax.training.stores import store
from paraflax.training.stores.shares import Share
from paraflax.training.stores.store import TOKENIZER, training_prompts  # noqa: F401

ARRAYS = ("prompts", "prompt_lens", "answers")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """What to generate: `examples` prompts of `min_prompt_len..max_prompt_len` tokens from the
  training split, each continued by `answer_len` greedy tokens, `batch_size` rows at a time."""
  examples: int = 2048
  answer_len: int = 128
  min_prompt_len: int = 32
  max_prompt_len: int = 96
  batch_size: int = 64
  seed: int = 0

  def __post_init__(self):
    for name in ("examples", "answer_len", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 1 <= self.min_prompt_len <= self.max_prompt_len:
      raise ValueError("need 1 <= min_prompt_len <= max_prompt_len, got "
                       f"{self.min_prompt_len}, {self.max_prompt_len}")


def greedy_answers(model, prompts_BxP: np.ndarray, prompt_lens_B: np.ndarray,
                   answer_len: int, *, mesh=None) -> np.ndarray:
  """The model's greedy AR continuations `[B, answer_len]` of right-padded prompts (no EOS
  stop), on `mesh` if given (as `generate`). One compilation per (batch, P, answer_len)."""
  from paraflax.decoding.generate import generate
  out = generate(model, prompts_BxP, max_new_tokens=answer_len, eos_id=None,
                 prompt_lengths=prompt_lens_B, max_prompt_len=prompts_BxP.shape[1], mesh=mesh)
  return np.asarray(out.tokens)


def collect(model, tokenizer, tokens: np.ndarray | store.Prompts, out: str | os.PathLike,
            cfg: TeacherConfig, *, source: str = "", progress: bool = True, mesh=None,
            axis_rules=None) -> Path:
  """Continue `cfg.examples` prompts greedily with `model` and store prompts and
  answers under `out`: random windows of the token stream `tokens` (`training_prompts`), or
  chosen `store.Prompts` (records' prompts: `examples` becomes their number).
  Resumes a partial store made with the same settings (on any mesh).

  `mesh`, `axis_rules` as for `generate`: the model sharded by the rules, each batch's
  prompts split over the data axes; multi-host, each process writes its rows (`shares.py`)."""
  out = Path(out).expanduser()
  cfg, prompts, lens, chosen = store.chosen_prompts(tokens, cfg)
  bs, p, a = cfg.batch_size, cfg.max_prompt_len, cfg.answer_len
  if p + a > model.cfg.max_seq_len:
    raise ValueError(f"max_prompt_len + answer_len = {p + a} exceeds the teacher's max_seq_len "
                     f"{model.cfg.max_seq_len}")
  meta = {**dataclasses.asdict(cfg), "source": str(source),
          "tokenizer": tokenizer.fingerprint(), **chosen}
  shapes = {"prompts": ((cfg.examples, p), (bs, p)), "prompt_lens": ((cfg.examples,), (bs,)),
            "answers": ((cfg.examples, a), (bs, a))}
  share = Share(sharding.resolve_mesh(mesh, axis_rules), bs)
  model = share.place(model)  # once, not per batch

  def make(i, lo, hi):
    pb, lb = (store.padded_batch(x, lo, hi, bs) for x in (prompts, lens))
    answers = greedy_answers(model, pb, lb, a, mesh=share.mesh)
    return {"prompts": prompts[lo:hi], "prompt_lens": lens[lo:hi], "answers": answers[:hi - lo]}

  with share.writing(out, what="teacher store"):
    arrays, done = share.open_store(out, meta, shapes, tokenizer, what="teacher store")
    store.fill(out, arrays, meta, done, make, desc=f"teacher answers A={a}", progress=progress,
               share=share)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class TeacherStore:
  """A complete teacher store read into memory."""
  meta: dict
  prompts: np.ndarray  # [N, P] right-padded
  prompt_lens: np.ndarray  # [N]
  answers: np.ndarray  # [N, A]

  def rows(self) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, P + A]: prompt then answer, right-padded with 0; lengths [N] = p + A)."""
    n, p = self.prompts.shape
    a = self.answers.shape[1]
    tokens = np.zeros((n, p + a), np.int32)
    tokens[:, :p] = self.prompts
    j = np.arange(a)[None, :]
    tokens[np.arange(n)[:, None], self.prompt_lens[:, None] + j] = self.answers
    return tokens, (self.prompt_lens + a).astype(np.int32)


def load(path: str | os.PathLike) -> TeacherStore:
  """Read a store; refuses one whose generation has not finished."""
  meta, arrays = store.read_store(path, ARRAYS, what="teacher store", command="teacher-data")
  return TeacherStore(meta=meta, **arrays)
