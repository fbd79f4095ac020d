"""Deprecated path (one release): `paraflax.hf.chat` is `paraflax.data.chat`."""

import warnings

from paraflax.data.chat import *  # noqa: F401, F403

warnings.warn("paraflax.hf.chat moved to paraflax.data.chat", DeprecationWarning, stacklevel=2)
