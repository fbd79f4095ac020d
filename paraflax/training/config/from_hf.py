"""`paraflax train --hf DIR --data FILE.jsonl`: a recipe config retargeted at a Hugging Face
model and the user's data.

    cfg = from_hf(load_config("tidar_continual"), "~/models/qwen2.5-0.5b",
                  ["train.jsonl"])

The recipe gives the method (objective and its arguments, `mask_token_id` / `sep_token_id`
needed or not, `two_stream`, `drafter_prefix`), the optimiser, the loop, the run control
(`cfg.run`, untouched) and the precision (dtypes); DIR gives the architecture (its
config.json), the weights (`init_from`) and the tokenizer (`data.tokenizer`), with the
method tokens (`data.mask_token` / `data.sep_token`, "<mask>" / "<sep>" unless set) added
when it lacks them. `model.vocab_size` covers both the checkpoint's rows and the tokenizer's
ids: the trainer grows the embedding for tokens the checkpoint has no rows for
(`workdir.initial_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from etils import epath

from paraflax.data.tokenizer import load_tokenizer
from paraflax.hf import auto_tokenizer
from paraflax.hf.config import model_config_from_hf, read_hf_config
from paraflax.paths import is_hf_dir, model_dirs, resolve_path
from paraflax.training.config.train import TrainConfig, read_config
from paraflax.training.objectives.protocol import objective

MASK, SEP = "<mask>", "<sep>"  # the method tokens' default strings
# data sources that are stores made by a command from a model and prompts
STORES = {"trajectories": "collect-trajectories", "teacher": "teacher-data"}
# what the recipe keeps of its model: the method's fields and its precision (a training choice;
# a bfloat16 checkpoint trains in float32 unless the recipe says otherwise)
KEPT = ("two_stream", "drafter_prefix", "dtype", "param_dtype")


def with_data(cfg: TrainConfig, data_paths: Sequence[str], hf_dir: str | None = None
              ) -> TrainConfig:
  """`cfg` training on the JSON Lines files `data_paths` (data source "jsonl"; the recipe's
  other jsonl arguments are kept). A recipe that trains on a store refuses them."""
  source = objective(cfg.objective).source
  if source in STORES:
    model = f"--hf {hf_dir}" if hf_dir else "--workdir MODEL"
    raise ValueError(
        f"objective {cfg.objective!r} trains on a {source} store, not on text: collect it first "
        f"with `paraflax {STORES[source]} {model} --data FILE --out STORE`, then train with "
        "`--set data_source_args.path=STORE` instead of --data")
  args = dict(cfg.data_source_args) if cfg.data_source == "jsonl" else {}
  args.pop("path", None)  # today's single-file argument, replaced by `paths`
  args["paths"] = tuple(resolve_path(str(p)) for p in data_paths)
  return dataclasses.replace(cfg, data_source="jsonl", data_source_args=args)


def architecture(model_dir: str):
  """The `ModelConfig` of a Hugging Face directory (its config.json) or of a training workdir
  (a run made from one: DEER Stage II from Stage I, a second Jacobi Forcing round); another
  directory is a one-line ValueError saying what was expected."""
  try:
    workdir, hf = model_dirs(model_dir)
  except ValueError as e:
    raise ValueError(f"--hf {e}") from None
  if hf:
    return model_config_from_hf(read_hf_config(hf))
  return read_config(epath.Path(workdir) / "config.json").model


def from_hf(cfg: TrainConfig, hf_dir: str, data_paths: Sequence[str] = ()) -> TrainConfig:
  """The recipe `cfg` starting from the Hugging Face checkpoint `hf_dir` (its architecture,
  weights and tokenizer; or a training workdir's, such as an earlier stage made from one), on
  `data_paths` (JSON Lines) when given, else on the recipe's data source encoded with
  `hf_dir`'s tokenizer (a store collected from it, or text)."""
  arch = architecture(hf_dir)  # first: a wrong directory says what was expected
  hf_dir = resolve_path(str(hf_dir))
  if is_hf_dir(hf_dir):  # a warning when transformers' AutoTokenizer encodes it otherwise
    auto_tokenizer.check(hf_dir, load_tokenizer(hf_dir))
  recipe = cfg.model
  data = cfg.data
  mask = data.mask_token or (MASK if recipe.mask_token_id is not None else None)
  sep = data.sep_token or (SEP if recipe.sep_token_id is not None else None)
  tok = load_tokenizer(hf_dir, mask_token=mask, sep_token=sep)  # [V_tok] ids
  model = dataclasses.replace(
      arch, vocab_size=max(arch.vocab_size, tok.vocab_size),  # rows for added tokens
      max_seq_len=max(arch.max_seq_len, data.seq_len),
      mask_token_id=tok.mask_id if mask else None, sep_token_id=tok.sep_id if sep else None,
      **{k: getattr(recipe, k) for k in KEPT})
  data = dataclasses.replace(data, tokenizer=hf_dir, mask_token=mask, sep_token=sep)
  cfg = dataclasses.replace(cfg, model=model, data=data, init_from=hf_dir)
  return with_data(cfg, data_paths, hf_dir) if data_paths else cfg
