"""Deprecated path (one release): `paraflax.mask_structure` is `paraflax.model.mask_structure`."""

import warnings

from paraflax.model.mask_structure import *  # noqa: F401, F403

warnings.warn("paraflax.mask_structure moved to paraflax.model.mask_structure",
              DeprecationWarning, stacklevel=2)
