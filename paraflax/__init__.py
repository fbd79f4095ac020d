"""paraflax: exact, batched, compile-once parallel decoding for language models."""

from paraflax import decoders, methods, sampling, verify
from paraflax.decoding.core import generate_fn
from paraflax.decoding.generate import generate, generate_steps
from paraflax.decoding.infill import infill
from paraflax.decoding.lattice import HOLE, InfillOutput
from paraflax.decoding.state import GenerateOutput
from paraflax.hf import export_hf, load_hf, load_hf_tokenizer
from paraflax.model import masks
from paraflax.model.cache import ChunkKV, KVCache, commit, init_cache
from paraflax.model.config import ModelConfig, RopeScaling
from paraflax.model.run import RunControl
from paraflax.model.transformer import Queries, Transformer
from paraflax.parallel import distributed, sharding
from paraflax.parallel.sharding import MeshConfig, make_mesh
from paraflax.sampling import Greedy, Temperature, TopK, TopP
from paraflax.training.workdirs.convert import convert_hf

__all__ = [
    "HOLE", "ChunkKV", "GenerateOutput", "Greedy", "InfillOutput", "KVCache", "ModelConfig",
    "Queries", "RopeScaling", "RunControl", "Temperature", "TopK", "TopP", "Transformer", "commit",
    "convert_hf", "decoders", "export_hf", "generate", "generate_fn", "generate_steps", "infill",
    "init_cache", "load_hf", "load_hf_tokenizer",
    "masks", "methods", "sampling", "verify",
    "MeshConfig", "distributed", "make_mesh", "sharding",
]

