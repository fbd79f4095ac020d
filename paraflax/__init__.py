"""paraflax: exact, batched, compile-once parallel decoding for language models."""

from paraflax import decoders, masks, sampling, verify
from paraflax.cache import ChunkKV, KVCache, commit, init_cache
from paraflax.config import ModelConfig
from paraflax.decoding.generate import generate, generate_steps
from paraflax.decoding.state import GenerateOutput
from paraflax.model import Transformer
from paraflax.sampling import Greedy, Temperature, TopK, TopP

__all__ = [
    "ChunkKV", "GenerateOutput", "Greedy", "KVCache", "ModelConfig", "Temperature", "TopK",
    "TopP", "Transformer", "commit", "decoders", "generate", "generate_steps", "init_cache",
    "masks", "sampling", "verify",
]
