"""Deprecated path (one release): `paraflax.attention` is `paraflax.model.attention`."""

import warnings

from paraflax.model.attention import *  # noqa: F401, F403

warnings.warn("paraflax.attention moved to paraflax.model.attention",
              DeprecationWarning, stacklevel=2)
