"""Decoders and the generate loop."""
