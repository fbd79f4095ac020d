"""Resumable stores of int32 arrays written batch by batch with tensorstore (zarr), made by a
model from prompts of the training split: the Jacobi trajectory store (`trajectories.py`) and
the DEER teacher store (`teacher.py`).

Prompts come from random windows of a training workdir's token stream (`training_prompts`), or
from JSONL records (`record_prompts`, the papers' setting: each record's own prompt).

A store is a directory:
    meta.json       the settings it was made with (`examples`, `batch_size`, ...): a store made
                    with other settings is refused, never mixed (its `source` model
                    directory compared resolved, however it was spelled)
    tokenizer.json  the tokenizer of the model that made it
    progress.json   {"batches": k}: the first k batches are on disk (filling resumes there)
    <name>/         one zarr int32 array per name, `[examples, ...]`, chunked by batch
    checksums.jsonl size and crc32 of the files (`training.workdirs.checksums`): one line for
                    the files made with the store, then one per batch for the chunk files it wrote,
                    appended before progress.json advances; verified by `read_store`
    paraflax.lock   held while a command fills the store (`writing`, `workdirs/lock.py`)

On a mesh, and across hosts, each process writes its own rows of each batch; process 0 alone
writes the other files (`shares.py`). Paths are `etils.epath` ones and the arrays' kvstore is
built from them (`paraflax.paths.kvstore`), so a store may live on `gs://`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorstore as ts
from etils.epath import Path
from tqdm.auto import tqdm

from paraflax import destination
from paraflax.data.tokenizer import Tokenizer
from paraflax.json_io import append_text, json_field, read_json_object, write_atomic, write_json
from paraflax.paths import kvstore, resolve_path
from paraflax.training.run.interrupt import Interrupted
from paraflax.training.workdirs import lock
from paraflax.training.workdirs.checksums import ChecksumError, ChecksumWarning, digest, verify

META, PROGRESS, TOKENIZER = "meta.json", "progress.json", "tokenizer.json"
CHECKSUMS = "checksums.jsonl"
# the int settings (>= 1) meta.json must hold: every store's, then each kind's own
META_INTS = ("examples", "batch_size")
KIND_INTS = {"trajectory store": ("max_prompt_len", "block_size", "num_blocks"),
             "teacher store": ("max_prompt_len", "answer_len")}


def checked_meta(path: Path, what: str) -> dict:
  """The meta.json of the store `path` (a `what`), its settings checked by shape: one
  ValueError line naming the file and the field otherwise."""
  file = path / META
  meta = read_json_object(file)
  for name in META_INTS + KIND_INTS.get(what, ()):
    json_field(file, meta, name, int, 1)
  return meta


def read_progress(path: Path) -> int:
  """The batches progress.json of the store `path` says are on disk (checked by shape)."""
  return json_field(path / PROGRESS, read_json_object(path / PROGRESS), "batches", int, 0)


class FewerExamples(UserWarning):
  """A store made from records holds fewer examples than asked: there are no more prompts."""


def training_prompts(tokens: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
  """`cfg.examples` random windows of a token stream: (prompts [N, P] right-padded, lengths).

  `cfg`: any config with `examples`, `min_prompt_len`, `max_prompt_len` (P) and `seed`.
  """
  rng = np.random.default_rng(cfg.seed)
  need = cfg.max_prompt_len + 1
  if len(tokens) < need:
    raise ValueError(f"the token stream has {len(tokens)} tokens, fewer than one prompt")
  lens = rng.integers(cfg.min_prompt_len, cfg.max_prompt_len + 1, cfg.examples)
  starts = rng.integers(0, len(tokens) - need, cfg.examples)
  prompts = np.zeros((cfg.examples, cfg.max_prompt_len), np.int32)
  for i, (s, n) in enumerate(zip(starts, lens)):
    prompts[i, :n] = tokens[s:s + n]
  return prompts, lens.astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Prompts:
  """Chosen prompts for a store, and how they were chosen."""
  tokens: np.ndarray  # int32 [N, P] right-padded (P = max_prompt_len)
  lengths: np.ndarray  # int32 [N]
  meta: dict  # what they came from, kept in meta.json (a changed data file is not resumed)
  counts: dict  # for the command's summary


def record_prompts(ids: Sequence[Sequence[int]], cfg, *, prefix: Sequence[bool] = (),
                   meta: Mapping | None = None) -> Prompts:
  """At most `cfg.examples` of the records' prompt ids `ids`, each record at most once, in an
  order drawn from `cfg.seed` (fewer records: all of them, with a `FewerExamples` warning).

  `prefix[i]`: record i is a document without a prompt (a text record), cut to its first n
  tokens, n uniform in [min_prompt_len, max_prompt_len]. A prompt shorter than
  `cfg.min_prompt_len` is skipped; one longer than `cfg.max_prompt_len` keeps its last
  max_prompt_len tokens (the end, where the continuation starts). Both are counted.
  """
  rng = np.random.default_rng(cfg.seed)
  lo, hi = cfg.min_prompt_len, cfg.max_prompt_len
  prefix = list(prefix) or [False] * len(ids)
  cuts = rng.integers(lo, hi + 1, len(ids))
  ids = [list(x[:n]) if cut else list(x) for x, cut, n in zip(ids, prefix, cuts)]
  usable = [i for i, x in enumerate(ids) if len(x) >= lo]
  if not usable:
    raise ValueError(f"none of the {len(ids)} records has a prompt of min_prompt_len={lo} "
                     "tokens or more: lower --min-prompt-len")
  order = [usable[j] for j in rng.permutation(len(usable))[:cfg.examples]]
  if len(order) < cfg.examples:
    warnings.warn(f"the records give {len(order)} usable prompts: the store holds "
                  f"{len(order)} examples, not the {cfg.examples} asked (examples)",
                  FewerExamples, stacklevel=2)
  tokens = np.zeros((len(order), hi), np.int32)
  lengths = np.zeros(len(order), np.int32)
  for row, i in enumerate(order):
    kept = ids[i][-hi:]
    tokens[row, :len(kept)], lengths[row] = kept, len(kept)
  digest = hashlib.sha1(tokens.tobytes() + lengths.tobytes()).hexdigest()
  counts = {"records": len(ids), "prompts_too_short": len(ids) - len(usable),
            "prompts_cut_to_max": sum(len(ids[i]) > hi for i in order)}
  return Prompts(tokens, lengths, {**(meta or {}), "prompts": digest}, counts)


def chosen_prompts(tokens, cfg):
  """(cfg, prompts int32 [N, P], lengths [N], meta): the given `Prompts` (records' prompts;
  `cfg.examples` becomes their number, their meta goes into the store's), or `cfg.examples`
  random windows of the token stream `tokens` (`training_prompts`)."""
  if isinstance(tokens, Prompts):
    cfg = dataclasses.replace(cfg, examples=len(tokens.lengths))
    return cfg, tokens.tokens, tokens.lengths, tokens.meta
  return (cfg, *training_prompts(tokens, cfg), {})


def open_array(path: Path, name: str, shape=None, chunk=None, *, create: bool = False):
  """The zarr int32 array `path/name`: opened, or created empty (replacing any old one)."""
  spec = {"driver": "zarr", "kvstore": kvstore(path / name),
          "store_data_equal_to_fill_value": True}  # every chunk a file, so each has a checksum
  if create:
    spec["metadata"] = {"shape": list(shape), "chunks": list(chunk), "dtype": "<i4"}
    return ts.open(spec, create=True, delete_existing=True).result()
  return ts.open(spec, open=True).result()


def num_batches(meta: Mapping) -> int:
  return -(-meta["examples"] // meta["batch_size"])


def writing(out: Path, *, what: str):
  """The lock a command holds while it fills the store `out` (one writer per store), once
  `out` is known to be new, empty or a `what` (`destination.check_store_dir`): stores resume
  in their own directory, and never fill another kind's or a user's other files."""
  destination.check_store_dir(out, what)
  return lock.hold(out, what=what)


def _resolved(meta: Mapping) -> dict:
  """`meta` with its `source` directory resolved (see `paraflax.paths.resolve_path`)."""
  source = meta.get("source")
  return {**meta, "source": resolve_path(source)} if source else dict(meta)


def open_store(out: Path, meta: dict, shapes: Mapping[str, tuple], tokenizer, *,
               what: str) -> tuple[dict, int]:
  """(arrays by name, batches already on disk) of the store at `out`.

  A partial or complete store made with the same `meta` is reopened (to resume); a store
  made with other settings is refused; anything else starts afresh: empty arrays of
  `shapes[name] = (shape, chunk)`, meta.json, tokenizer.json and progress 0.
  """
  done, meta = 0, _resolved(meta)
  if (out / META).is_file() and (out / PROGRESS).is_file():
    old = _resolved(checked_meta(out, what))
    if old != meta:
      diff = sorted(k for k in set(meta) | set(old) if old.get(k) != meta.get(k))
      raise ValueError(f"{str(out)!r} holds a {what} made with other settings "
                       f"({', '.join(diff)}); use a fresh directory")
    done = read_progress(out)
  if done:
    _trim_checksums(out, done)
    return {k: open_array(out, k) for k in shapes}, done
  out.mkdir(parents=True, exist_ok=True)
  write_json(out / META, meta)  # first: a store killed while starting is still one of its kind
  arrays = {k: open_array(out, k, *shapes[k], create=True) for k in shapes}
  tokenizer.save(out / TOKENIZER)
  write_json(out / PROGRESS, {"batches": 0})
  made = [META, TOKENIZER] + [f"{k}/.zarray" for k in shapes]
  _write_lines(out / CHECKSUMS, [{"batch": None, "files": digest(out, made)}])
  return arrays, 0


def _chunk_files(array, name: str, lo: int, hi: int) -> list[str]:
  """The zarr chunk files (`name/i.j.k`) holding rows lo..hi of `array`."""
  chunk = array.chunk_layout.write_chunk.shape
  first = range(lo // chunk[0], (hi - 1) // chunk[0] + 1)
  rest = [range(-(-n // c)) for n, c in zip(array.shape[1:], chunk[1:])]
  return [f"{name}/" + ".".join(map(str, i)) for i in itertools.product(first, *rest)]


def _write_lines(path: Path, lines: list[dict]) -> None:
  write_atomic(path, "".join(json.dumps(x) + "\n" for x in lines))


def _read_lines(path: Path, *, strict: bool) -> list[dict]:
  """The lines of a checksum log (a line cut by a kill is dropped, or refused if `strict`)."""
  out = []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if strict:
        raise ValueError(f"{path}: line {n} is not valid JSON (truncated or corrupt)") from None
  return out


def _trim_checksums(out: Path, done: int) -> None:
  """Keep the checksums of the store's own files and batches 0..done-1 (resuming)."""
  if (out / CHECKSUMS).is_file():  # older stores have none, and keep none
    lines = _read_lines(out / CHECKSUMS, strict=False)
    _write_lines(out / CHECKSUMS, [x for x in lines if x["batch"] is None or x["batch"] < done])


def verify_store(path: Path, total: int, what: str) -> bool:
  """Check the store's files against checksums.jsonl (False when it has none); a file that
  differs is a `ChecksumError` naming it."""
  log = path / CHECKSUMS
  if not log.is_file():
    return False
  files, batches = {}, set()
  for x in _read_lines(log, strict=True):
    if x["batch"] is None or x["batch"] < total:
      files.update(x["files"])  # a chunk written twice: its last line counts
      batches.add(x["batch"])
  missing = sorted(set(range(total)) - batches)
  if None not in batches or missing:
    lost = "the store's own files" if None not in batches else f"batch {missing[0]}"
    raise ChecksumError(log, f"has no checksums for {lost} of this {what}")
  verify(path, files, CHECKSUMS)
  return True


def padded_batch(a: np.ndarray, lo: int, hi: int, size: int) -> np.ndarray:
  """Rows lo..hi of `a`, the last one repeated up to `size` rows (one compiled shape)."""
  return np.concatenate([a[lo:hi], np.repeat(a[hi - 1:hi], size - (hi - lo), 0)])


def fill(out: Path, arrays: Mapping, meta: Mapping, done: int,
         make: Callable[[int, int, int], Mapping[str, np.ndarray]], *, desc: str,
         progress: bool = True, postfix: Callable[[Mapping], dict] | None = None,
         share=None) -> None:
  """Write batches `done..` : `make(i, lo, hi)` returns rows lo..hi of every array. progress.json
  advances only after a batch is on disk, so a killed fill resumes at the first unwritten one.

  `share` (a `shares.Share`, on a mesh or multi-host): this process writes its rows of each
  batch; after a barrier, process 0 alone logs the checksums and advances progress.json."""
  total, bs = num_batches(meta), meta["batch_size"]
  primary = share is None or share.primary
  bar = tqdm(total=total, initial=done, desc=desc, unit="batch",
             disable=not progress or not primary, dynamic_ncols=True)
  try:
    for i in range(done, total):
      lo, hi = i * bs, min((i + 1) * bs, meta["examples"])
      rows = make(i, lo, hi)
      own = [(0, hi - lo)] if share is None else share.rows(hi - lo)
      for w in [arrays[k][lo + a:lo + b].write(v[a:b]) for k, v in rows.items() for a, b in own]:
        w.result()
      if share is not None:
        share.sync(f"{out} batch {i}")  # every process's rows are on disk
      if not primary:
        continue
      if (out / CHECKSUMS).is_file():
        written = [f for k in rows for f in _chunk_files(arrays[k], k, lo, hi)]
        append_text(out / CHECKSUMS, json.dumps({"batch": i, "files": digest(out, written)}) + "\n")
      write_json(out / PROGRESS, {"batches": i + 1})  # only after the data is on disk
      bar.update(1)
      if postfix is not None:
        bar.set_postfix(**postfix(rows))
    if share is not None:
      share.sync(f"{out} filled")  # progress.json is final for every process
  except KeyboardInterrupt:  # Ctrl-C: what progress.json says is on disk is kept
    kept = read_progress(out)
    raise Interrupted(f"interrupted: {kept} of {total} batches are kept in {out}; run the "
                      "same command again to resume") from None
  finally:
    bar.close()


def read_meta(path: str | os.PathLike, *, what: str, command: str) -> dict:
  """The meta.json of the store at `path` (a one-line FileNotFoundError when there is none)."""
  path = Path(path).expanduser()
  if not (path / META).is_file():
    raise FileNotFoundError(f"no {what} at {str(path)!r} (make one with `paraflax {command}`)")
  return checked_meta(path, what)


def check_row_length(path: str | os.PathLike, what: str, length: int, how: str,
                     seq_len: int) -> None:
  """Refuse a run whose `data.seq_len` is not the store's row `length` (`how`: its sum)."""
  if length != seq_len:
    raise ValueError(f"{what} {str(path)!r} has rows of {length} tokens ({how}) but "
                     f"data.seq_len={seq_len}: set data.seq_len={length} (the row length)")


def read_store(path: str | os.PathLike, names, *, what: str,
               command: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(meta, arrays by name) of a complete store; refuses a missing or unfinished one."""
  path = Path(path).expanduser()
  meta = read_meta(path, what=what, command=command)
  total = num_batches(meta)
  done = read_progress(path) if (path / PROGRESS).is_file() else 0
  if done < total:
    raise ValueError(f"{what} {str(path)!r} is incomplete ({done}/{total} batches): rerun "
                     f"`paraflax {command}` with the same settings to finish it")
  if not verify_store(path, total, what):
    warnings.warn(f"{what} {str(path)!r} has no checksums (made before paraflax wrote them): "
                  "reading it unverified", ChecksumWarning, stacklevel=3)
  return meta, {k: np.asarray(open_array(path, k).read().result()) for k in names}


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """The tokenizer of the model that made the store at `path` (what training on it uses)."""
  return Tokenizer.load(Path(path).expanduser() / TOKENIZER)


def tokenizer_source(path: str | os.PathLike, kind: str) -> str:
  """Where `load_tokenizer(path)` reads from, for messages."""
  return f"{str(Path(path) / TOKENIZER)!r} (the {kind} store's)"
