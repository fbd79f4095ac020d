"""Deprecated path (one release): `paraflax.distributed` is `paraflax.parallel.distributed`."""

import warnings

from paraflax.parallel.distributed import *  # noqa: F401, F403

warnings.warn("paraflax.distributed moved to paraflax.parallel.distributed",
              DeprecationWarning, stacklevel=2)
