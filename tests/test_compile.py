"""`paraflax perf compile`: the kernel counter and custom-call costing on a hand-built program
whose counts are known, targets and run control resolved per target, and a micro model's
training step and decode loop compiled for a GPU and a TPU target (deviceless, on this CPU)."""

import dataclasses
import math
import re

import jax
import pytest

from paraflax import decoders
from paraflax.decoding import core
from paraflax.model import attention
from paraflax.hlo import Instruction, computations
from paraflax.model.run import RunControl
from paraflax.perf.compile import costs, kernels, targets
from paraflax.perf.compile import run as compile_run
from paraflax.perf.rows import check
from paraflax.perf.shapes import model_config
from paraflax.perf.train import RECIPES

# a while of 5 known trips (body: an exp fusion, a cuBLAS GEMM, a scalar add; condition: a
# compare), an async pair around a reduction, a conditional whose branches launch 1 and 3
# kernels, a copy
HAND = """HloModule hand, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_exp (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %e = f32[8,8]{1,0} exponential(%p)
}

%fused_sum (p: f32[8,8]) -> f32[8] {
  %p = f32[8,8]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%p, %z), dimensions={1}, to_apply=%add_f32
}

%fused_dot (p: f32[8,8], q: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %q = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  %g = (f32[8,8]{1,0}, s8[64]{0}) custom-call(%y, %y), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gy = f32[8,8]{1,0} get-tuple-element(%g), index=0
  ROOT %out = (s32[], f32[8,8]{1,0}) tuple(%next, %gy)
}

%cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%small (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  ROOT %y = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
}

%large (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %y = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  %z = f32[8,8]{1,0} fusion(%y, %y), kind=kOutput, calls=%fused_dot
  ROOT %w = f32[8,8]{1,0} fusion(%z), kind=kLoop, calls=%fused_exp
}

%async_wrapped (x: f32[8,8]) -> f32[8] {
  %x = f32[8,8]{1,0} parameter(0)
  ROOT %r = f32[8]{0} fusion(%x), kind=kInput, calls=%fused_sum
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %lx = f32[8,8]{1,0} get-tuple-element(%loop), index=1
  %start = ((f32[8,8]{1,0}), f32[8]{0}, s32[]) async-start(%lx), calls=%async_wrapped
  %done = f32[8]{0} async-done(%start)
  %p = pred[] constant(true)
  %branch = f32[8,8]{1,0} conditional(%p, %lx, %lx), true_computation=%small, false_computation=%large
  ROOT %c = f32[8,8]{1,0} copy(%branch)
}
"""
GEMM_FLOPS = 2 * 8 * 8 * 8  # the custom call: [8, 8] x [8, 8]
OBJECTIVES = tuple(RECIPES)  # every objective perf compiles


@pytest.fixture(autouse=True)
def _default_matmul_precision():
  """The precision a bf16 run has (`perf compile`'s, not conftest's "highest": Mosaic TPU
  refuses splash attention's bf16 dots at "highest", "Bad lhs type")."""
  with jax.default_matmul_precision("default"):
    yield


@pytest.mark.fast
def test_kernels_counted_on_a_hand_built_program():
  gpu = kernels.Program(HAND, "gpu").count()
  # 5 trips x 3 (a known trip count runs no condition) + the async pair once + the larger
  # branch (3) + the copy
  assert gpu.kernels == 5 * 3 + 1 + 3 + 1
  assert gpu.syncs == 1  # the conditional; the while's trip count is known
  assert gpu.mix["gemm"] == 5 + 1 and gpu.mix["reduction"] == 1 and gpu.mix["copy"] == 1
  tpu = kernels.Program(HAND, "tpu").count()
  assert tpu.kernels == 5 * 2 + 1 + 3 + 1  # the scalar add runs on the scalar core
  assert tpu.syncs == 0 and tpu.mix["scalar"] == 5
  # no known_trip_count (as XLA:TPU writes loops): read off `i < 5` from i = 0
  inferred = HAND.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
  assert kernels.Program(inferred, "gpu").count().kernels == gpu.kernels
  unknown = inferred.replace("direction=LT", "direction=NE")
  counted = kernels.Program(unknown, "gpu").count()
  # an unknown trip count: body and condition counted once, and its predicate is a sync
  assert counted.kernels == 3 + 1 + 1 + 3 + 1 and counted.syncs == 2


@pytest.mark.fast
def test_a_splash_call_with_tokamax_causal_mask_is_costed_by_the_tiles_it_runs():
  """splash takes a causal mask as its static `CausalMask` (the grid leaves out the tiles
  above the diagonal); tokamax names the mask in the call's metadata, a bool mask as data,
  and its config the tile: the tiles on or below the diagonal run whole."""
  payload = lambda mask, config="": (
      r'metadata={op_name="attention" metadata_payload="tokamax:{\"op\":{\"config\":{'
      + config + r'}},\"arguments' + rf'\":{{\"mask\":{{{mask}}}}}}}"}}')
  shapes = {"q": "bf16[14,4096,64]{2,1,0}", "k": "bf16[2,4096,64]{2,1,0}",
            "v": "bf16[2,4096,64]{2,1,0}"}

  def flops(mask, config="", name="splash_mha_fwd_residuals.3"):
    rest = '%q, %k, %v), custom_call_target="tpu_custom_call", ' + payload(mask, config)
    return costs.custom_call_flops(
        Instruction(name, "bf16[14,4096,64]{2,1,0}", "custom-call", rest), shapes)
  square = 4.0 * 14 * 4096 * 64 * 4096
  causal = r'\"bool_mask\":null,\"causal_mask\":{\"offset\":0}'
  assert flops(r'\"bool_mask\":null,\"causal_mask\":null') == square
  assert flops(causal) == square / 2  # no tile named: the triangle
  # 32 x 32 tiles of 128: 528 run; the backward's 128 x 512: 144 of 256
  assert flops(causal, r'\"block_q\":128,\"block_kv\":128') == square * 528 / 1024
  assert flops(causal, r'\"block_q_dkv\":128,\"block_kv_dkv\":512',
               "splash_mha_dkv_no_residuals.3") == 2.5 * square * 144 / 256
  assert costs.causal_tiles(4096, 4096, 128, 512) == 144 / 256


@pytest.mark.fast
def test_a_splash_call_in_a_tiles_scope_is_costed_by_the_tiles_it_runs():
  """A splash call over a dense mask whose structure leaves tiles empty in every row runs in
  the name scope `splash_tiles_{run}_of_{tiles}` (`attention.splash_tiles`), forward and
  backward; its FLOPs are the square's times run / tiles."""
  shapes = {"q": "bf16[14,1792,64]{2,1,0}", "k": "bf16[2,2304,64]{2,1,0}",
            "v": "bf16[2,2304,64]{2,1,0}"}

  def flops(name, op_name):
    rest = (r'%q, %k, %v), custom_call_target="tpu_custom_call", metadata={op_name="'
            + op_name + r'" metadata_payload="tokamax:{\"arguments\":{\"mask\":{\"bool_mask'
            r'\":{},\"causal_mask\":null}}}"}')
    return costs.custom_call_flops(Instruction(name, "bf16[14,1792,64]{2,1,0}", "custom-call",
                                               rest), shapes)
  square = 4.0 * 14 * 1792 * 64 * 2304
  fwd = "jit(f)/jvp(splash_tiles_161_of_252)/vmap(jit(_splash_attention))/pallas_call"
  bwd = "jit(f)/transpose(jvp(splash_tiles_161_of_252))/vmap(splash_mha_dkv)/pallas_call"
  assert flops("splash_mha_fwd_residuals.1", fwd) == square * 161 / 252
  assert flops("splash_mha_dkv_no_residuals.1", bwd) == 2.5 * square * 161 / 252
  assert flops("splash_mha_fwd_residuals.1", "jit(f)/jvp()/pallas_call") == square


@pytest.mark.fast
def test_custom_calls_are_costed_and_counted_per_trip():
  program = kernels.Program(HAND, "gpu")
  comps, _ = computations(HAND)
  gemm = next(i for i in comps["body"] if i.op == "custom-call")
  shapes = {i.name: i.shape for i in comps["body"]}
  assert costs.custom_call_flops(gemm, shapes) == GEMM_FLOPS
  total = costs.Costs(program).of()
  assert total["uncosted"] == 0
  # another custom call moves data: its bytes, no FLOPs
  bare = costs.Costs(kernels.Program(HAND.replace("__cublas$gemm", "my_kernel"), "gpu")).of()
  assert bare["uncosted"] == 0 and total["flops"] - bare["flops"] == 5 * GEMM_FLOPS
  # a GEMM whose dot dimensions cannot be read: uncosted, once per trip
  blind = HAND.replace("lhs_contracting_dimensions", "lhs_unknown")
  assert costs.Costs(kernels.Program(blind, "gpu")).of()["uncosted"] == 5
  # its bytes: operands + results (the workspace too), every trip; XLA's analysis gives none
  call_bytes = 2 * 8 * 8 * 4 + (8 * 8 * 4 + 64)
  assert costs.Costs(program)._custom_calls("body")["bytes"] == call_bytes
  xla_only = costs.Costs(program).xla("main")["bytes"]
  assert total["bytes"] >= xla_only + 5 * call_bytes


@pytest.mark.fast
def test_a_gather_and_an_in_place_scatter_are_charged_what_they_touch():
  """XLA's analysis charges a fused gather of 16 rows its whole table, an in-place scatter
  of 16 slots its whole buffer in and out; `Costs` charges the rows and the updates."""
  import jax.numpy as jnp
  table = jax.ShapeDtypeStruct((4096, 256), jnp.float32)  # 4 MiB
  rows = jax.ShapeDtypeStruct((16,), jnp.int32)
  cache = jax.ShapeDtypeStruct((4, 1, 1024, 2, 64), jnp.float32)  # 2 MiB
  update = jax.ShapeDtypeStruct((4, 1, 16, 2, 64), jnp.float32)
  slots = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  commit = lambda c, u, i: c.at[:, jnp.arange(1)[:, None], i].set(u)
  for f, args, donate, touched in (
      (lambda t, i: t[i] * 2, (table, rows), (), 16 * 256 * 4),
      (commit, (cache, update, slots), (0,), 4 * 16 * 2 * 64 * 4)):
    text = jax.jit(f, donate_argnums=donate).lower(*args).compile().as_text()
    whole = 4 * math.prod(args[0].shape)
    xla = costs.hlo.cost_analysis(text)["bytes accessed"]
    ours = costs.Costs(kernels.Program(text, "cpu")).of()["bytes"]
    assert xla >= whole  # the artifact, still there
    assert touched <= ours < whole / 4


# a TPU program's memories: a weight W (HBM, 64 KiB) sliced into VMEM (`S(1)`) by an async
# DMA, then a fusion reading the slice (VMEM) and x (HBM), writing its result to HBM; a layout
# call that concatenates in place
TPU_HAND = """HloModule tpu_hand

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_mv (w: f32[64,128], x: f32[128]) -> f32[64] {
  %w = f32[64,128]{1,0:T(8,128)S(1)} parameter(0)
  %x = f32[128]{0:T(128)} parameter(1)
  %bx = f32[64,128]{1,0:T(8,128)} broadcast(%x), dimensions={1}
  %m = f32[64,128]{1,0:T(8,128)} multiply(%w, %bx)
  %z = f32[] constant(0)
  ROOT %r = f32[64]{0:T(128)} reduce(%m, %z), dimensions={1}, to_apply=%add_f32
}

ENTRY %main (w: f32[128,128], x: f32[128]) -> f32[128] {
  %w = f32[128,128]{1,0:T(8,128)} parameter(0)
  %x = f32[128]{0:T(128)} parameter(1)
  %start.0 = ((f32[128,128]{1,0:T(8,128)}), f32[64,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:64], [0:128]}
  %done.0 = f32[64,128]{1,0:T(8,128)S(1)} slice-done(%start.0)
  %y0 = f32[64]{0:T(128)} fusion(%done.0, %x), kind=kLoop, calls=%fused_mv
  %start.1 = ((f32[128,128]{1,0:T(8,128)}), f32[64,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[64:128], [0:128]}
  %done.1 = f32[64,128]{1,0:T(8,128)S(1)} slice-done(%start.1)
  %y1 = f32[64]{0:T(128)} fusion(%done.1, %x), kind=kLoop, calls=%fused_mv
  ROOT %y = f32[128]{0:T(128)} custom-call(%y0, %y1), custom_call_target="ConcatBitcast"
}
"""


@pytest.mark.fast
def test_a_tpu_program_is_charged_its_hbm_bytes_and_its_dmas_are_no_kernels():
  """W is read from HBM once (by the two DMAs), not again where the fusions read its slices
  in VMEM; x is read from HBM by each fusion and each result written there; the in-place
  concatenation moves nothing. Neither the DMAs nor the concatenation is a kernel."""
  program = kernels.Program(TPU_HAND, "tpu")
  count = program.count()
  assert count.kernels == 2 and count.mix["dma"] == 2 and count.mix["layout"] == 1
  w, x, y = 128 * 128 * 4, 128 * 4, 128 * 4  # y: 64 floats of a fusion in a 128-float tile
  cost = costs.Costs(program)
  assert cost.of()["bytes"] == pytest.approx(w + 2 * (x + y))
  assert cost.hbm.fallbacks == 0
  # the whole text's analysis, which charges W's slices again in VMEM, counts more
  assert costs.hlo.cost_analysis(TPU_HAND)["bytes accessed"] > cost.of()["bytes"] + w / 2
  # as a GPU reads the same text (no memories): every access
  assert costs.Costs(kernels.Program(TPU_HAND, "gpu")).of()["bytes"] > cost.of()["bytes"]


# rows of a table gathered on chip: the table T and the indices copied into VMEM, the gather
# fusion reading and writing VMEM alone (TiDAR's mixed head rows), its result copied to HBM
TPU_GATHER = """HloModule tpu_gather

%fused_gather (t: f32[8,20,128], i: s32[8,20,2]) -> f32[160,128] {
  %t = f32[8,20,128]{2,0,1:T(8,128)S(1)} parameter(0)
  %i = s32[8,20,2]{2,1,0:T(8,128)S(1)} parameter(1)
  %g = f32[8,20,128]{2,1,0:T(8,128)} gather(%t, %i), offset_dims={2}, collapsed_slice_dims={0,1}, start_index_map={0,1}, index_vector_dim=2, slice_sizes={1,1,128}
  ROOT %r = f32[160,128]{1,0:T(8,128)S(1)} reshape(%g)
}

ENTRY %main (t: f32[8,20,128], i: s32[8,20,2]) -> f32[160,128] {
  %t = f32[8,20,128]{2,0,1:T(8,128)} parameter(0)
  %i = s32[8,20,2]{2,1,0:T(8,128)} parameter(1)
  %ts = (f32[8,20,128]{2,0,1:T(8,128)S(1)}, f32[8,20,128]{2,0,1:T(8,128)}, u32[]{:S(2)}) copy-start(%t)
  %td = f32[8,20,128]{2,0,1:T(8,128)S(1)} copy-done(%ts)
  %is = (s32[8,20,2]{2,1,0:T(8,128)S(1)}, s32[8,20,2]{2,1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%i)
  %id = s32[8,20,2]{2,1,0:T(8,128)S(1)} copy-done(%is)
  %g = f32[160,128]{1,0:T(8,128)S(1)} fusion(%td, %id), kind=kCustom, calls=%fused_gather
  %gs = (f32[160,128]{1,0:T(8,128)}, f32[160,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%g)
  ROOT %gd = f32[160,128]{1,0:T(8,128)} copy-done(%gs)
}
"""


@pytest.mark.fast
def test_a_tpu_instruction_on_chip_alone_moves_no_hbm_bytes():
  """The gather fusion reads and writes VMEM only: the program moves T and the indices in
  and the rows out, once each (XLA's analysis of the fusion alone charges its gather)."""
  cost = costs.Costs(kernels.Program(TPU_GATHER, "tpu"))
  t, i, rows = 160 * 128 * 4, 160 * 2 * 4, 160 * 128 * 4
  assert cost.of()["bytes"] == pytest.approx(t + i + rows)
  assert cost.hbm.fallbacks == 0


ASYNC_ALL_REDUCE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %m = f32[8]{0} multiply(%p, %p)
  %start = ((f32[8]{0}), f32[8]{0}) all-reduce-start(%m), channel_id=1, replica_groups={{0,1}}, \
use_global_device_ids=true, to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  ROOT %done = f32[8]{0} all-reduce-done(%start)
}
"""  # the all-reduce-start is one line: its backslash joins the two


@pytest.mark.fast
def test_a_collective_that_prints_its_aliasing_is_costed():
  """XLA:GPU prints an async all-reduce's aliased buffers (a training step on a mesh of GPUs),
  which XLA's parser refuses outside custom calls: the cost analysis reads the module without
  them (before, `perf compile --target h100:2` failed for every objective)."""
  assert costs.hlo.cost_analysis(ASYNC_ALL_REDUCE)["flops"] >= 8  # the multiply at least
  assert "output_to_operand_aliasing" not in costs.hlo.parsable(ASYNC_ALL_REDUCE)


@pytest.mark.fast
def test_targets_parse_and_refuse_in_one_line():
  assert targets.parse("h200").capacity > 140 * 2**30
  assert targets.parse("tpu-v5e:2x4").chips == 8 and targets.parse("h100:2").chips == 2
  for bad in ("h300", "tpu-v5e:2", "h100:2x2", "tpu-v6e:0x1"):
    with pytest.raises(ValueError) as e:
      targets.parse(bad)
    assert "\n" not in str(e.value)


@pytest.mark.fast
def test_run_control_resolves_for_the_target_not_this_host():
  cfg = model_config("qwen2.5-0.5b", "bfloat16")
  host = RunControl()
  assert host.backend() == "cpu" and host.attention_for(cfg, 4096) == "xla_chunked"
  assert RunControl(platform="tpu").attention_for(cfg, 4096) == "mosaic|xla_chunked"
  assert RunControl(platform="gpu").attention_for(cfg, 1, cached=True) == "gpu_decode"
  assert RunControl(platform="tpu").resolved(cfg, 4096) == {
      "attention": "mosaic|xla_chunked", "remat": "full", "scan_layers": True, "platform": "tpu"}
  assert core.resolve_steps_per_iter(None, decoders.AR(), 64) == 1  # this CPU
  assert core.resolve_steps_per_iter(None, decoders.AR(), 64, "gpu") == 4
  with pytest.raises(ValueError, match="platform"):
    RunControl(platform="cuda")


def test_micro_programs_compile_for_a_gpu_and_a_tpu_target(tmp_path, monkeypatch):
  """Every objective's training step on the GPU (DEER stage I's on the TPU: rows of W+1
  tokens, padded to splash attention's blocks) and two decode loops (one with a drafter) per
  target; every TPU compile in this one process (libtpu allows one). A training step runs
  the target's fused attention kernel in every layer, and no conditional (a host sync on a
  GPU) in any objective's step. Splash's backward under AR's causal mask takes key blocks of
  `attention.splash_keys` (one partial dq per block). The GPU's autotuning off
  (`targets.compiler_options`) compiles AR's step to the program XLA's default level
  compiles, instruction for instruction, its GEMMs' Triton tile configs included."""
  for target in ("h200", "tpu-v5e"):
    rows, log = [], []
    objectives = OBJECTIVES if target == "h200" else ("ar", "deer_stage1")
    plan = compile_run.CompilePlan(target=target, shape="micro", objectives=objectives,
                                   decoders=("ar", "speculative"), batches=(2,), seq_len=256,
                                   cache_len=128, new_tokens=16, hlo=str(tmp_path))
    errors = compile_run.run(plan, rows.append, log.append)
    assert errors == [], errors
    env = {"device": targets.parse(target).device_kind, "backend": "gpu", "jax": "x",
           "command": "test", "utc": ""}
    for row in rows:
      check({**env, **row})
      assert row["compiled_only"] and row["target"] == target and row["defaults"]
      assert row["uncosted_custom_calls"] == 0 and row["bytes_per_step"] > 0
      assert 0 < row["memory"]["total"] < row["memory"]["capacity"]
      assert sum(row["kernel_mix"].values()) >= row["kernels_per_step"]
    by = {(r["program"], r.get("objective") or r["decoder"]): r for r in rows}
    train, ar, spec = by["train", "ar"], by["decode", "ar"], by["decode", "speculative"]
    assert set(by) == {("train", o) for o in objectives} | {
        ("decode", "ar"), ("prefill", "ar"), ("decode", "speculative")}
    kernel = "attention:cudnn" if target == "h200" else "attention:splash_mha_fwd_residuals"
    for name in objectives:
      mix, layers = by["train", name]["kernel_mix"], 2  # the micro shape's layers
      assert mix.get(kernel, 0) >= layers and "conditional" not in mix, (name, mix)
      assert by["train", name]["host_syncs_per_step"] == 0
      # the memory fit: none fitted before the first that fits; the one compiled (the last
      # tried: that one, or remat on fewer layers after it) fits
      fit = by["train", name]["fit"]
      first = next(i for i, c in enumerate(fit) if c["fits"])
      assert fit[-1]["fits"] and len(fit) - first <= 2
      assert fit[-1]["remat"] == by["train", name]["run_control"]["remat"]
    if target == "h200":  # Jacobi Forcing's streams: two calls a layer, forward and backward
      assert by["train", "jacobi_forcing"]["kernel_mix"]["attention:cudnn"] == 2 * 2 * layers
    assert train["host_syncs_per_step"] == 0 and train["run_control"]["platform"] == (
        "gpu" if target == "h200" else "tpu")
    assert train["flops_per_step"] >= train["model_flops_per_step"] > 0
    per = ar["run_control"]["steps_per_iter"]
    assert per == 4  # an accelerator's, not this CPU's 1
    # a GPU waits on the loop's predicate once per iteration; a TPU never
    assert ar["host_syncs_per_step"] == (1 / per if target == "h200" else 0)
    assert spec["kernels_per_drafter_forward"] > 0 and spec["kernels_per_target_forward"] > 0
    if target == "h200":  # a TPU's are HBM's: a micro model's weights may stay on chip
      assert ar["bytes_per_step"] >= 0.5 * ar["floor_bytes"]
      ours = (tmp_path / "h200_train_ar_1x256.hlo.txt").read_text()
      with monkeypatch.context() as m:  # XLA's default autotuning level
        m.setattr(targets, "compiler_options", lambda target: {})
        xla = dataclasses.replace(plan, objectives=("ar",), decoders=(), hlo=str(tmp_path / "x"))
        assert compile_run.run(xla, lambda row: None, log.append) == []
      xlas = (tmp_path / "x" / "h200_train_ar_1x256.hlo.txt").read_text()
      assert "__triton_nested_gemm_fusion" in ours and _same_program(ours, xlas)
    else:
      step = (tmp_path / "tpu-v5e_train_ar_1x256.hlo.txt").read_text()
      blocks = set(re.findall(r'block_kv_dkv\\":(\d+)', step))
      assert blocks == {str(attention.splash_keys(256))} == {"256"}, blocks


# what XLA writes differently at autotuning level 0: a loop fusion's empty backend config and
# the module's fingerprint before scheduling (and, in any two compiles, source lines)
_LEVEL0_NOTES = "|".join((
    r', metadata=\{[^}]*\}', r'fingerprint_before_lhs="[0-9a-f]+"', r'^\d+ \{file_name_id=.*$',
    r', backend_config=\{"operation_queue_id":"0","force_earliest_schedule":false,'
    r'"reification_cost":\[\],"device_type":"DEVICE_TYPE_INVALID",'
    r'"native_emitter_backend_config":\{"type":"NATIVE_EMITTER_TYPE_INVALID",'
    r'"unroll_factor":0\}\}'))


def _same_program(a: str, b: str) -> bool:
  return re.sub(_LEVEL0_NOTES, "", a, flags=re.M) == re.sub(_LEVEL0_NOTES, "", b, flags=re.M)


@pytest.mark.fast
def test_calibration_pairs_programs_and_fits_kernels_and_bytes():
  from paraflax.perf.compile import calibrate
  base = {"kind": "compile", "device": "NVIDIA H200 141GB HBM3e", "jax": "x", "batch": 1}
  compiled, measured = [], []
  for i, (kernels_, gb) in enumerate([(500, 1.0), (2000, 1.2), (40000, 5.0), (3000, 20.0)]):
    rc = {"attention": "xla_chunked", "remat": "full", "scan_layers": True, "platform": "gpu"}
    compiled.append({**base, "program": "train", "objective": "ar", "seq_len": 512 * (i + 1),
                     "run_control": rc, "kernels_per_step": kernels_, "bytes_per_step": gb * 1e9,
                     "flops_per_step": 1e12 * (i % 2)})
    ms = 3e-3 * kernels_ + gb * 1e9 / 4e12 * 1e3  # 3 µs a kernel, 4 TB/s
    measured.append({"kind": "train", "device": "NVIDIA H200", "jax": "y", "batch": 1,
                     "objective": "ar", "seq_len": 512 * (i + 1), "step_s": ms / 1e3,
                     **{k: rc[k] for k in ("attention", "remat", "scan_layers")}})
  measured.append({**measured[0], "remat": "none", "step_s": 9.0})  # another program
  pairs = calibrate.pairs(compiled, measured)
  assert len(pairs) == 4 and all(p["ms"] != 9000 for p in pairs)
  f = calibrate.fit(pairs)
  assert f["coefficients"]["kernels"] == pytest.approx(3e-3)  # ms a kernel
  assert 1e-9 / f["coefficients"]["bytes"] == pytest.approx(4.0)  # TB/s
  assert all(abs(r["residual"]) < 1e-9 for r in f["rows"])
  assert "ms = 3.00 µs x kernels + bytes / 4.00 TB/s (largest residual 0%)" in (
      calibrate.render(pairs))
  with pytest.raises(ValueError, match="2 pairs"):
    calibrate.fit(pairs[:1])


def test_micro_programs_compile_on_a_tpu_mesh():
  """FSDP training and a decode loop with its rows split over four v5e chips: every figure one
  device's (the decode loop's cache holds one chip's row)."""
  rows, log = [], []
  plan = compile_run.CompilePlan(target="tpu-v5e:2x2", shape="micro", objectives=("ar",),
                                 decoders=("ar",), batches=(4,), seq_len=256, cache_len=128,
                                 new_tokens=16)
  assert compile_run.run(plan, rows.append, log.append) == []
  by = {r["program"]: r for r in rows}
  assert set(by) == {"train", "decode", "prefill"}
  assert by["train"]["host_syncs_per_step"] == 0 and by["decode"]["host_syncs_per_step"] == 0
  one = []  # one chip, one row: the same floor as each chip of the mesh
  compile_run.run(dataclasses.replace(plan, target="tpu-v5e", objectives=(), batches=(1,)),
                  one.append, log.append)
  assert by["decode"]["floor_bytes"] == one[0]["floor_bytes"]


def test_micro_training_steps_compile_on_a_gpu_mesh():
  """FSDP training over two H100s, with Jacobi Forcing's windows: compiled and costed (XLA's
  cost analysis reads the module's async collectives: `hlo.parsable`)."""
  rows, log = [], []
  plan = compile_run.CompilePlan(target="h100:2", shape="micro",
                                 objectives=("ar", "jacobi_forcing"), decoders=(), seq_len=256)
  assert compile_run.run(plan, rows.append, log.append) == []
  for row in rows:
    assert row["uncosted_custom_calls"] == 0 and row["flops_per_step"] > 0
    assert row["kernel_mix"]["attention:cudnn"] >= 2 and row["host_syncs_per_step"] == 0
