"""The model floor: the architecture (`config`), run control (`run`), the NNX decoder
(`transformer`), masked attention (`attention`), the KV cache (`cache`), the pure mask
builders (`masks`) and their tile structure (`mask_structure`)."""

import warnings

_MODULES = ("attention", "cache", "config", "mask_structure", "masks", "run", "transformer")


def __getattr__(name: str):
  """`paraflax.model.Transformer` (...), the module this package replaced: deprecated (one
  release), `paraflax.model.transformer` holds them."""
  if name.startswith("_") or name in _MODULES:  # a submodule: imported, not looked up
    raise AttributeError(f"module 'paraflax.model' has no attribute {name!r}")
  from paraflax.model import transformer
  if not hasattr(transformer, name):
    raise AttributeError(f"module 'paraflax.model' has no attribute {name!r}")
  warnings.warn(f"paraflax.model.{name} moved to paraflax.model.transformer.{name}",
                DeprecationWarning, stacklevel=2)
  return getattr(transformer, name)
