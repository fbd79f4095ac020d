"""Deprecated path (one release): `paraflax.deer_layout` is `paraflax.decoding.deer_layout`."""

import warnings

from paraflax.decoding.deer_layout import *  # noqa: F401, F403

warnings.warn("paraflax.deer_layout moved to paraflax.decoding.deer_layout",
              DeprecationWarning, stacklevel=2)
