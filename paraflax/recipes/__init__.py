"""The shipped training recipes: Python files exposing `get_config() -> TrainConfig`,
installed with the package and named by their path here without `.py` ("tiny_ar",
"hf/sft"): `paraflax train --config hf/sft`, `load_config("tiny_ar")`
(`paraflax/training/config/recipes.py`)."""
