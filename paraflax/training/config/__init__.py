"""Configuration: `TrainConfig` and its JSON round trip (`train`), `--set` overrides
(`overrides`), values checked against their annotations (`fields`), the shipped recipes found by
name (`recipes`), and a recipe retargeted at a Hugging Face model (`from_hf`)."""
