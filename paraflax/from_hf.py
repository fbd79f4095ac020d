"""Deprecated path (one release): `paraflax.from_hf` is `paraflax.training.from_hf`."""

import warnings

from paraflax.training.from_hf import *  # noqa: F401, F403

warnings.warn("paraflax.from_hf moved to paraflax.training.from_hf",
              DeprecationWarning, stacklevel=2)
