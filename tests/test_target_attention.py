"""Attention compiled for accelerator targets on this CPU host (deviceless, `perf/compile`):
"auto" on a TPU for every prompt length and on a mesh (Mosaic kernels in a shard_map), and the
explicit GPU kernels on a 2-GPU mesh. Only compiled, never run; each test that expects a
kernel checks the compiled HLO calls it, so a fix that always falls back fails here.

libtpu serves one process at a time: every TPU compile runs in this pytest process.
"""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, SingleDeviceSharding

import paraflax as pf
from paraflax.model import attention
from paraflax.model.run import RunControl
from paraflax.parallel import sharding
from paraflax.perf.compile import run as compile_run
from paraflax.perf.compile import targets
from paraflax.perf.shapes import model_config
from paraflax.training.config.train import load_config
from paraflax.training.objectives.protocol import objective
from paraflax.training.run.dry_run import abstract_batch, abstract_state
from paraflax.training.run.step import jit_train_step

KERNEL_CALLS = {"mosaic": "tpu_custom_call", "cudnn": "__cudnn$fmha",
                "triton": "__gpu$xla.gpu.triton"}  # in the compiled HLO text
MAX_LEN = 2048  # above attention.DENSE_MAX_LEN: "auto" does not pick dense xla for the model


@pytest.fixture(autouse=True)
def _default_matmul_precision():
  """The precision a bf16 run has: conftest's "highest" (for float32 exactness) makes Mosaic TPU
  refuse splash attention's bf16 dots ("Bad lhs type"), and the library sets "highest" only
  for float32 compute, where "auto" picks no kernel."""
  with jax.default_matmul_precision("default"):
    yield


def _target(spec: str):
  """(target, its abstract devices); skipped where the compile extra's plugin is missing."""
  target = targets.parse(spec)
  plugin = "libtpu" if target.platform == "tpu" else "jax_plugins.xla_cuda13"
  if importlib.util.find_spec(plugin) is None:
    pytest.skip(f"{spec}: needs {plugin} (pip install -e '.[compile]')")
  return target, targets.devices(target)


def _mesh(devs, shape) -> Mesh:
  return Mesh(np.array(devs).reshape(shape), sharding.AXES, axis_types=(AxisType.Auto,) * 3)


def _compile(target, fn, *args, mesh=None) -> str:
  """The compiled HLO text of `jax.jit(fn)(*args)` for `target` (under `mesh`), as `perf
  compile` compiles (`targets.compiler_options`)."""
  with targets.compiling_for(target), sharding.use_mesh(mesh):
    return jax.jit(fn).lower(*args).compile(targets.compiler_options(target)).as_text()


def _abstract_model(platform: str, attention_: str = "auto", **shape):
  cfg = model_config("micro", "bfloat16", max_seq_len=MAX_LEN, **shape)
  run = RunControl(platform=platform, attention=attention_)
  return nnx.eval_shape(lambda: pf.Transformer(cfg, rngs=nnx.Rngs(0), run=run))


def _train_step_text(target, devs, mesh_shape, attention_: str = "auto") -> str:
  """The real `jit_train_step` of a micro recipe (bf16, 8 rows of 128 tokens) on a mesh."""
  cfg = load_config("micro_ar")
  cfg = dataclasses.replace(
      cfg, model=model_config("micro", "bfloat16", max_seq_len=MAX_LEN, vocab_size=320),
      data=dataclasses.replace(cfg.data, seq_len=128, batch_size=8),
      run=dataclasses.replace(cfg.run, platform=target.platform, attention=attention_))
  mesh = _mesh(devs, mesh_shape)
  graphdef, params, tx, opt_state = abstract_state(cfg, mesh)
  batch = abstract_batch(cfg, mesh)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(mesh))
  step = jit_train_step(graphdef, objective(cfg.objective).bind(cfg.objective_args), tx, mesh,
                        params, opt_state)
  with targets.compiling_for(target):
    return step.lower(params, opt_state, batch, key).compile(
        targets.compiler_options(target)).as_text()


def _decode_text(target, devs, mesh_shape, decoder, prompt_len: int,
                 attention_: str = "auto", **shape) -> str:
  """`pf.generate_fn`'s loop (4 rows, 16 new tokens) with weights and rows on a mesh."""
  model = _abstract_model(target.platform, attention_, **shape)
  mesh = _mesh(devs, mesh_shape)
  params = sharding.abstract_state(nnx.state(model), mesh)
  fn = pf.generate_fn(model, decoder, max_new_tokens=16, eos_id=2)
  on_rows = lambda shape: sharding.batch_sharding(shape, mesh)  # noqa: E731
  prompts = jax.ShapeDtypeStruct((4, prompt_len), jnp.int32, sharding=on_rows((4, prompt_len)))
  lengths = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=on_rows((4,)))
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
  return _compile(target, fn, params, prompts, lengths, rng, mesh=mesh)


def test_auto_runs_splash_attention_for_every_length():
  """Splash attention's 128-blocks are padded (`attention._padded`), so "auto" picks it for
  any length on a TPU (xla_chunked stays the fallback for shapes the kernel declines), but
  for a step of up to 128 rows over a cache (the decode rule: the TPU decode layer in 16 bits,
  its attention dense, the cache read in place)."""
  r, bf16 = attention.resolve, jnp.bfloat16
  for rows in (8, 64, 136, 256):  # padded prompts; a TiDAR prefill (128 + 8)
    assert r("auto", "tpu", bf16, max_len=MAX_LEN, rows=rows) == ("mosaic", "xla_chunked")
  assert r("auto", "tpu", bf16, max_len=MAX_LEN, rows=136, cached=True) == ("mosaic",
                                                                            "xla_chunked")
  for rows in (64, 72, 80, 128):  # decode rule: TiDAR k=8's steps, the released MR loop's
    assert r("auto", "tpu", bf16, max_len=MAX_LEN, rows=rows, cached=True) == "tpu_decode"
    assert r("auto", "tpu", jnp.float32, max_len=MAX_LEN, rows=rows, cached=True) == "xla"
  assert r("mosaic", "tpu", bf16, rows=64) == "mosaic"  # an explicit value is taken as given


def test_tpu_prefill_compiles_for_every_prompt_length():
  """Cache-free calls (a prefill) of 8, 64 and 128 tokens, and calls over a cache: "auto"
  compiles for every length and runs splash attention, its 128-blocks padded."""
  target, (dev,) = _target("tpu-v5e")
  graphdef, params = nnx.split(_abstract_model("tpu"))
  on_dev = SingleDeviceSharding(dev)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_dev), params)

  def forward(params, tokens_BxT):
    b, t = tokens_BxT.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return nnx.merge(graphdef, params)(tokens_BxT, positions,
                                       pf.masks.causal(jnp.full((b,), t), t))[0]

  for t in (8, 64, 128):
    text = _compile(target, forward, params, jax.ShapeDtypeStruct((2, t), jnp.int32,
                                                                  sharding=on_dev))
    assert KERNEL_CALLS["mosaic"] in text, t

  def over_cache(q, k, v, cache_k, cache_v):
    t, s = q.shape[1], cache_k.shape[1]
    mask = jnp.ones((q.shape[0], t, s + t), bool)
    return attention.attend(q, k, v, mask, attention="auto", cache_kv=(cache_k, cache_v),
                            max_len=MAX_LEN, backend="tpu")

  for t, s in ((136, 1024), (256, 896)):  # past the decode rule: 136 rows; 256 over 1152 keys
    qkv = [jax.ShapeDtypeStruct((2, t, h, 8), jnp.bfloat16, sharding=on_dev) for h in (4, 2, 2)]
    cache = [jax.ShapeDtypeStruct((2, s, 2, 8), jnp.bfloat16, sharding=on_dev)] * 2
    text = _compile(target, over_cache, *qkv, *cache)
    assert KERNEL_CALLS["mosaic"] in text, (t, s)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 1), (1, 2, 2)], ids=["data_fsdp", "fsdp_tensor"])
def test_tpu_training_step_compiles_on_a_mesh(mesh_shape):
  target, devs = _target("tpu-v5e:2x2")
  assert KERNEL_CALLS["mosaic"] in _train_step_text(target, devs, mesh_shape)


def test_tpu_sharded_decoding_compiles():
  """An AR loop whose 128-token prefill runs the kernel (heads over "tensor"), and a TiDAR
  loop whose 64-token prompt and first mask block (72 rows) run it too, its blocks padded
  (its 72-row steps: the decode rule's dense path)."""
  target, devs = _target("tpu-v5e:2x2")
  text = _decode_text(target, devs, (1, 2, 2), pf.decoders.AR(), 128)
  assert KERNEL_CALLS["mosaic"] in text
  text = _decode_text(target, devs, (2, 1, 2), pf.decoders.TiDAR(8), 64)
  assert KERNEL_CALLS["mosaic"] in text


@pytest.mark.parametrize("program", ["train", "decode"])
@pytest.mark.parametrize("kernel", ["cudnn", "triton"])
def test_gpu_kernels_compile_sharded_on_two_gpus(kernel, program):
  """The explicit GPU kernels (bf16) in a training step with heads over "tensor", and in a
  decode loop with rows over "data", on two H100s."""
  target, devs = _target("h100:2")
  if program == "train":
    text = _train_step_text(target, devs, (1, 1, 2), kernel)
  else:
    text = _decode_text(target, devs, (2, 1, 1), pf.decoders.AR(), 64, kernel)
  assert KERNEL_CALLS[kernel] in text


def test_gpu_decode_steps_run_the_decode_kernel_over_the_cache_in_place():
  """A 16-bit decode loop on one H200 (heads 16 wide, as the kernel takes): AR's and
  Jacobi's steps call the decode kernel once per layer, each given the whole stacked cache
  (so no layer's slots are copied out of it); micro's 8-wide heads stay dense."""
  target, devs = _target("h200")
  for decoder in (pf.decoders.AR(), pf.decoders.Jacobi(8)):
    text = _decode_text(target, devs, (1, 1, 1), decoder, 64, d_model=64)
    calls = [line for line in text.splitlines()
             if "paraflax_decode_attention" in line and "custom-call(" in line]
    assert len(calls) >= 2, type(decoder).__name__  # the micro shape's 2 layers
    cache = "bf16[2,4,"  # [layers, rows, slots, kv heads, head dim]
    assert all(line.count(cache) >= 2 for line in calls)
  dense = _decode_text(target, devs, (1, 1, 1), pf.decoders.AR(), 64)
  assert "paraflax_decode_attention" not in dense


def test_gpu_decode_layers_are_five_kernels():
  """Heads 32 wide (RoPE's halves a dot's 16): every layer of an AR step is the decode
  layer's four matmuls around the attention kernel (`decode_layer.py`) and its head the
  greedy head (`greedy_head.py`: no float32 logits); TiDAR k=8's steps (72 rows a sequence,
  288 in all) run the attention kernel and the decode layer too."""
  target, devs = _target("h200")
  text = _decode_text(target, devs, (1, 1, 1), pf.decoders.AR(), 64, d_model=128)
  calls = lambda name: sum(name in line and "custom-call(" in line for line in text.splitlines())
  assert calls("paraflax_qkv_matmul") == calls("paraflax_decode_attention") >= 2
  assert calls("paraflax_matmul") == 2 * calls("paraflax_gated_matmul") == 2 * calls(
      "paraflax_qkv_matmul")
  assert calls("paraflax_argmax_matmul") >= 1
  text = _decode_text(target, devs, (1, 1, 1), pf.decoders.TiDAR(8), 64, d_model=128)
  assert calls("paraflax_qkv_matmul") == calls("paraflax_decode_attention") >= 2


def test_tpu_decode_layers_are_four_kernels():
  """Heads 64 wide: every layer of a 16-bit AR step on a TPU v5e is the TPU decode layer's
  four Mosaic kernels (`tpu_decode_layer.py`: q/k/v, the attention kernel over the cache in
  place, the output projection, the MLP), and no layer's weights are copied into another
  layout inside the loop (the kernels take wq, wk and wv transposed, as XLA:TPU keeps them);
  Jacobi's 16-row steps run them too, and each step's head is the greedy head kernel
  (`tpu_greedy_head.py`: no logits in HBM)."""
  target, devs = _target("tpu-v5e")
  for decoder in (pf.decoders.AR(), pf.decoders.Jacobi(16)):
    text = _decode_text(target, devs, (1, 1, 1), decoder, 64, d_model=256)
    defined = [line.split("=")[0].split()[-1] for line in text.splitlines()
               if "custom-call(" in line]
    calls = lambda name: sum(d.startswith(f"%{name}.") for d in defined)  # noqa: E731
    assert calls("paraflax_tpu_qkv_matmul") >= 2, type(decoder).__name__  # micro's 2 layers
    assert (calls("paraflax_tpu_qkv_matmul") == calls("paraflax_tpu_decode_attention")
            == calls("paraflax_tpu_matmul") == calls("paraflax_tpu_mlp_matmul"))
    assert not any("copy(" in line and "wq_ref" in line for line in text.splitlines())
    assert calls("paraflax_tpu_argmax_matmul") >= 1


def test_tpu_decoding_compiles_at_batch_8_for_a_full_cache():
  """Every decoder's prefill gives splash attention a structured mask (a prompt's causal rows
  as its own causal mask). A dense prefill mask made the kernel derive its block layout from
  the array, and at the 0.5B width, batch 8 and 2,048 cache slots (2 layers suffice) XLA:TPU
  failed to compile that ("Reshape should have supported layout before reaching the
  emitter") for every decoder. One decode step a loop iteration: the prefill is what this
  checks, and each step unrolled in the loop compiles its layers' Mosaic kernels again."""
  _target("tpu-v5e")
  plan = compile_run.CompilePlan(target="tpu-v5e", layers=2, objectives=(),
                                 decoders=("ar", "tidar:4"), batches=(8,), new_tokens=16,
                                 steps_per_iter=1)
  rows = []
  assert compile_run.run(plan, rows.append, lambda _: None) == []
  assert {(r["program"], r["decoder"]) for r in rows} == {
      ("decode", "ar"), ("prefill", "ar"), ("decode", "tidar")}
