"""Deprecated path (one release): `paraflax.sharding` is `paraflax.parallel.sharding`."""

import warnings

from paraflax.parallel.sharding import *  # noqa: F401, F403

warnings.warn("paraflax.sharding moved to paraflax.parallel.sharding",
              DeprecationWarning, stacklevel=2)
