"""Deprecated path (one release): `paraflax.checksums` is `paraflax.training.checksums`."""

import warnings

from paraflax.training.checksums import *  # noqa: F401, F403

warnings.warn("paraflax.checksums moved to paraflax.training.checksums",
              DeprecationWarning, stacklevel=2)
