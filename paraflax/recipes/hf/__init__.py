"""Recipes for your own Hugging Face model (`paraflax train --config hf/sft --hf DIR`)."""
