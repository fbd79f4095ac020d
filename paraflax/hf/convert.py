"""Deprecated path (one release): `paraflax.hf.convert` is `paraflax.training.convert`."""

import warnings

from paraflax.training.convert import *  # noqa: F401, F403

warnings.warn("paraflax.hf.convert moved to paraflax.training.convert",
              DeprecationWarning, stacklevel=2)
