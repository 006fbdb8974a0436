"""xformer.op_profile: op times from a jax.profiler trace, per step, by kind and category.

A hand-written trace (GPU streams and CPU thunks, as XSpace text) checks the arithmetic and
the attribution rules against figures worked out by hand; a real CPU trace written by
train_lib.StepProfiler checks that the trace, the saved HLO and the CLI fit together."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData

from xformer import op_profile
from xformer.timing import TrainClock
from xformer.train_lib import StepProfiler

HLO = """HloModule jit_train_step, entry_computation_layout={(f32[64,64]{1,0})->f32[64,64]{1,0}}

%fused_dot (param_0: f32[64,64]) -> f32[64,64] {
  %param_0 = f32[64,64]{1,0} parameter(0)
  ROOT %dot.1 = f32[64,64]{1,0} dot(%param_0, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_transpose (param_0.1: f32[64,64]) -> f32[64,64] {
  %param_0.1 = f32[64,64]{1,0} parameter(0)
  ROOT %transpose.2 = f32[64,64]{0,1} transpose(%param_0.1), dimensions={1,0}
}

%fused_dropout (param_0.2: f32[64,64]) -> f32[64,64] {
  %param_0.2 = f32[64,64]{1,0} parameter(0)
  ROOT %multiply.3 = f32[64,64]{1,0} multiply(%param_0.2, %param_0.2)
}

ENTRY %main.9 (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  %gemm_fusion = f32[64,64]{1,0} fusion(%p), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp()/dot_general" stack_frame_id=2}
  %custom-call.4 = (bf16[64,64]{1,0}, s8[1024]{0}) custom-call(%p, %p), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/transpose(jvp())/dot_general" stack_frame_id=2}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %custom-call.5 = (bf16[8,64,4,16]{3,2,1,0}, f32[8,4,64]{2,1,0}) custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/dot_product_attention" stack_frame_id=1}
  %all-reduce-start = f32[64,64]{1,0} all-reduce-start(%p), replica_groups={}, to_apply=%fused_dropout
  %loop_transpose_fusion = f32[64,64]{0,1} fusion(%p), kind=kLoop, calls=%fused_transpose
  %while.7 = f32[64,64]{1,0} while(%p), condition=%fused_transpose, body=%fused_dot
  ROOT %loop_multiply_fusion = f32[64,64]{1,0} fusion(%p), kind=kLoop, calls=%fused_dropout, metadata={op_name="jit(train_step)/mul" stack_frame_id=3}
}

FileNames
1 "/home/user/xformer/xformer/attention.py"
2 "/home/user/xformer/xformer/linear.py"
3 "/home/user/xformer/xformer/dropout.py"

FunctionNames
1 "dot_product_attention"
2 "over_rows"
3 "Dropout.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=60}
2 {file_name_id=2 function_name_id=2 line=20}
3 {file_name_id=3 function_name_id=3 line=44}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=1}
"""  # noqa: E501 (HLO lines as XLA writes them)


def _xspace(planes: list[tuple[str, dict[str, list[tuple]]]]) -> str:
    """XSpace text proto. planes: (name, {line name: [(event name, offset_us, duration_us,
    {stat: value})]})."""
    out = []
    for pid, (plane, lines) in enumerate(planes, 1):
        names = sorted({e[0] for events in lines.values() for e in events})
        stats = sorted({k for events in lines.values() for e in events for k in e[3]})
        body = []
        for lid, (line, events) in enumerate(lines.items(), 1):
            body.append(f'lines {{ id: {lid} name: "{line}" timestamp_ns: 0')
            for name, start, duration, values in events:
                body.append(
                    f"events {{ metadata_id: {names.index(name) + 1} "
                    f"offset_ps: {int(start * 1e6)} duration_ps: {int(duration * 1e6)}"
                )
                for key, value in values.items():
                    kind = "int64_value" if isinstance(value, int) else "str_value"
                    value = value if isinstance(value, int) else f'"{value}"'
                    body.append(
                        f"stats {{ metadata_id: {100 + stats.index(key)} {kind}: {value} }}"
                    )
                body.append("}")
            body.append("}")
        body += [
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
            for i, n in enumerate(names, 1)
        ]
        body += [
            f'stat_metadata {{ key: {100 + i} value {{ id: {100 + i} name: "{s}" }} }}'
            for i, s in enumerate(stats)
        ]
        out.append(f'planes {{ id: {pid} name: "{plane}" ' + " ".join(body) + " }")
    return "\n".join(out)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    return str(path)


def op(name: str, module: str = "jit_train_step") -> dict:
    return {"hlo_op": name, "hlo_module": module}


def test_parse_hlo_kinds_shapes_and_sources():
    ops = op_profile.parse_hlo(HLO)
    expected = {  # name: (kind, shape, source)
        "gemm_fusion": ("matmul", "f32[64,64]", "linear.py:over_rows:20"),
        "custom-call.4": ("matmul", "(bf16[64,64], s8[1024])", "linear.py:over_rows:20"),
        "custom-call.5": (
            "fused attention",
            "(bf16[8,64,4,16], f32[8,4,64])",
            "attention.py:dot_product_attention:60",
        ),
        "all-reduce-start": ("collective", "f32[64,64]", ""),
        "loop_transpose_fusion": ("transpose", "f32[64,64]", ""),
        "while.7": ("control flow", "f32[64,64]", ""),
        "loop_multiply_fusion": ("elementwise", "f32[64,64]", "dropout.py:Dropout.__call__:44"),
    }
    for name, (kind, shape, source) in expected.items():
        assert (ops[name].kind, ops[name].shape, ops[name].source) == (kind, shape, source), name
    assert ops["custom-call.4"].op_name == "jit(train_step)/transpose(jvp())/dot_general"
    # bytes: result + operands (not the GEMM call's s8[1024] scratch space); FLOPs: 2 x
    # [64, 64] outputs x 64 contracted, from the dot in the fusion's body or from the GEMM
    # call's dimension numbers
    f32 = 64 * 64 * 4
    assert (ops["gemm_fusion"].bytes, ops["gemm_fusion"].flops) == (2 * f32, 2 * 64**3)
    assert (ops["custom-call.4"].bytes, ops["custom-call.4"].flops) == (
        64 * 64 * 2 + 2 * f32,
        2 * 64**3,
    )
    assert ops["loop_multiply_fusion"].bytes == 2 * f32 and ops["loop_multiply_fusion"].flops == 0
    assert ops["while.7"].bytes == 0  # its body's ops are counted themselves


LIBRARY_FRAMES_HLO = """HloModule jit_train_step

ENTRY %main.3 (p: f32[8,8]) -> bf16[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %cast = bf16[8,8]{1,0} convert(%p), metadata={op_name="jit(train_step)/convert_element_type" stack_frame_id=4}
  %norm = f32[] reduce(%p, %p), dimensions={0,1}, to_apply=%add, metadata={op_name="jit(train_step)/reduce_sum" stack_frame_id=5}
  %lone = f32[] reduce(%p, %p), dimensions={0,1}, to_apply=%add, metadata={op_name="jit(train_step)/reduce_sum" stack_frame_id=6}
  ROOT %out = bf16[8,8]{1,0} copy(%cast), metadata={op_name="jit(train_step)/copy" stack_frame_id=3}
}

FileNames
1 "/work/xformer/xformer/train_lib.py"
2 "/work/xformer/xformer/linear.py"
3 "/venv/lib/python3.12/site-packages/flax/nnx/nn/dtypes.py"
4 "/venv/lib/python3.12/site-packages/flax/nnx/nn/helpers.py"
5 "/venv/lib/python3.12/site-packages/optax/tree_utils/_tree_math.py"

FunctionNames
1 "train_step"
2 "over_rows"
3 "promote_dtype"
4 "<genexpr>"
5 "tree_sum"

FileLocations
1 {file_name_id=1 function_name_id=1 line=112}
2 {file_name_id=2 function_name_id=2 line=23}
3 {file_name_id=3 function_name_id=3 line=80}
4 {file_name_id=4 function_name_id=4 line=82}
5 {file_name_id=5 function_name_id=5 line=187}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}
5 {file_location_id=5 parent_frame_id=2}
6 {file_location_id=5 parent_frame_id=1}
"""  # noqa: E501


def test_library_frames_count_where_the_project_called_them():
    """jax 0.11 keeps flax's and optax's frames in the HLO's stacks (printed parent ids are one
    more than the parent's id): an op counts at the innermost frame of the project's own code,
    and only a stack without one keeps its library frame."""
    ops = op_profile.parse_hlo(LIBRARY_FRAMES_HLO)
    # train_step -> over_rows -> promote_dtype -> <genexpr>: the cast is linear.py's
    assert ops["cast"].source == "linear.py:over_rows:23"
    assert ops["out"].source == "linear.py:over_rows:23"  # promote_dtype, called by over_rows
    assert ops["norm"].source == "train_lib.py:train_step:112"  # tree_sum, called by train_step
    assert ops["lone"].source == "_tree_math.py:tree_sum:187"  # a stack of library code alone


def test_gpu_trace_sums_stream_kernels_per_step(tmp_path):
    """Two steps on two streams: every kernel of the program counts once per step under its HLO
    op; derived lines, other modules' kernels and the host's own events do not; unattributed
    device time is reported."""
    stream = [  # (kernel, start us, duration us, stats), two steps
        ("gemm_a", 0, 300, op("gemm_fusion")),
        ("gemm_b", 300, 100, op("custom-call.4")),
        ("fmha_fwd", 400, 50, op("custom-call.5")),
        ("fmha_bwd", 450, 150, op("custom-call.5")),  # one HLO op, two kernels
        ("transpose", 600, 20, op("loop_transpose_fusion")),
        ("mul", 620, 10, op("loop_multiply_fusion")),
        ("memcpy", 630, 40, {}),  # no op claims it
        ("eval_gemm", 700, 500, op("gemm_fusion", "jit_eval_step")),  # another program
    ]
    stream += [(k, s + 2000, d, st) for k, s, d, st in stream]
    nccl = [("nccl_allreduce", 100, 60, op("all-reduce-start"))]
    nccl += [(k, s + 2000, d, st) for k, s, d, st in nccl]
    derived = [("gemm_fusion", 0, 300, op("gemm_fusion"))]  # xprof's "XLA Ops" line
    host = [("train", 0, 700, {"step_num": 0}), ("train", 2000, 700, {"step_num": 1})]
    host += [("gemm_fusion", 0, 5, op("gemm_fusion"))]  # a launch on the host
    trace = _write(
        tmp_path,
        _xspace(
            [
                ("/host:CPU", {"python": host}),
                (
                    "/device:GPU:0",
                    {"Stream #7(Compute)": stream, "Stream #9(NCCL)": nccl, "XLA Ops": derived},
                ),
            ]
        ),
    )
    summary = op_profile.summarise(trace, HLO, top=50)
    assert summary["plane"] == "device" and summary["steps"] == 2
    ms = {r["op"]: r["ms_per_step"] for r in summary["top_ops"]}
    assert ms == pytest.approx(
        {
            "gemm_fusion": 0.300,
            "custom-call.4": 0.100,
            "custom-call.5": 0.200,
            "all-reduce-start": 0.060,
            "loop_transpose_fusion": 0.020,
            "loop_multiply_fusion": 0.010,
        }
    )
    calls = {r["op"]: r["kernels_per_step"] for r in summary["top_ops"]}
    assert calls["custom-call.5"] == 2 and calls["gemm_fusion"] == 1
    assert summary["op_ms_per_step"] == pytest.approx(0.690)
    assert summary["unclaimed_device_ms_per_step"] == pytest.approx(0.040)  # the memcpys only
    assert summary["span_ms_per_step"] == pytest.approx((2630 - 0) / 2 / 1e3)
    by_category = {r["category"]: r["ms_per_step"] for r in summary["categories"]}
    assert by_category == pytest.approx(
        {
            "matmul: dense layers": 0.400,
            "fused attention (cuDNN)": 0.200,
            "collectives": 0.060,
            "layout transposes / copies": 0.020,
            "dropout": 0.010,
        }
    )
    assert [r["op"] for r in summary["top_ops"]][:2] == ["gemm_fusion", "custom-call.5"]
    dense = next(r for r in summary["categories"] if r["category"] == "matmul: dense layers")
    f32 = 64 * 64 * 4  # two GEMMs of 2 x 64^3 FLOPs in 0.4 ms, their bytes over the same time
    assert dense["gflop_per_s"] == pytest.approx(2 * 2 * 64**3 / 0.4e-3 / 1e9)
    moved = 2 * f32 + (64 * 64 * 2 + 2 * f32)  # gemm_fusion, custom-call.4
    assert dense["gb_per_s"] == pytest.approx(moved / 0.4e-3 / 1e9)
    # the cuDNN call's two kernels are one run: its bytes count once
    fmha = next(r for r in summary["top_ops"] if r["op"] == "custom-call.5")
    fmha_bytes = op_profile.parse_hlo(HLO)["custom-call.5"].bytes
    assert fmha["gb_per_s"] == pytest.approx(fmha_bytes / 0.200e-3 / 1e9)
    transpose = next(r for r in summary["top_ops"] if r["op"] == "loop_transpose_fusion")
    assert transpose["gb_per_s"] == pytest.approx(2 * f32 / 0.020e-3 / 1e9)
    assert transpose["gflop_per_s"] is None
    assert sum(r["share"] for r in summary["categories"]) == pytest.approx(1.0)


def test_cpu_trace_reads_the_host_plane_and_custom_categories(tmp_path):
    """No device plane: XLA:CPU thunks on the host threads count, an enclosing thunk only with
    its own time; a caller's categories (here one by kind, first) take precedence in order;
    ops the HLO lacks are counted and shown."""
    thunks = [
        ("while.1", 0, 3000, op("while.1")),  # encloses the three ops of its body
        ("gemm_fusion", 0, 2000, op("gemm_fusion")),
        ("loop_multiply_fusion", 2000, 500, op("loop_multiply_fusion")),
        ("copy.9", 2500, 250, op("copy.9")),
    ]
    trace = _write(tmp_path, _xspace([("/host:CPU", {"tf_XLAEigen/1": thunks})]))
    categories = (("square [64, 64] dots", lambda o: o.kind == "matmul"),) + op_profile.CATEGORIES
    summary = op_profile.summarise(trace, HLO, steps=1, categories=categories)
    assert summary["plane"] == "host" and summary["unclaimed_device_ms_per_step"] == 0
    by_category = {r["category"]: r["ms_per_step"] for r in summary["categories"]}
    assert by_category == pytest.approx(  # other: copy.9 and the while's own 0.25 ms
        {"square [64, 64] dots": 2.0, "dropout": 0.5, "other": 0.5}
    )
    assert summary["op_ms_per_step"] == pytest.approx(3.0) == summary["span_ms_per_step"]
    assert summary["ops_not_in_hlo"] == 2
    with pytest.raises(ValueError, match="no 'train' step annotations"):
        op_profile.summarise(trace, HLO)
    with pytest.raises(ValueError, match="no XLA op of a module ending in 'eval_step'"):
        op_profile.summarise(trace, HLO, steps=1, module="eval_step")


def test_step_profiler_saves_the_program_and_the_cli_ranks_its_ops(tmp_path, capsys, caplog):
    """A real CPU trace of two steps of a jitted `train_step`: StepProfiler writes its optimized
    HLO beside the trace; every op the trace times is an op of that HLO, the dot is the
    matmul, and the CLI prints and writes the same summary."""
    caplog.set_level(logging.INFO)

    def train_step(x):
        return jnp.tanh(x @ x.T) * 0.5

    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
    compiled = jax.jit(train_step).lower(x).compile()
    profiler = StepProfiler("1:3", str(tmp_path), 0, TrainClock(), compiled.as_text)
    for step in range(4):
        profiler.before_step(step, x)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            x = compiled(x)
        profiler.after_step(step + 1, x)
    profiler.close()

    trace = op_profile.newest_trace(str(tmp_path / "profile"))
    run = trace.rsplit("/", 1)[0]
    with open(f"{run}/{op_profile.HLO_FILE}") as f:
        hlo = f.read()
    assert hlo == compiled.as_text()
    summary = op_profile.summarise(trace, hlo)
    assert summary["steps"] == 2 and summary["plane"] == "host"
    assert summary["ops_not_in_hlo"] == 0
    ops = op_profile.parse_hlo(hlo)
    assert {r["op"] for r in summary["top_ops"]} <= set(ops)
    matmuls = [r for r in summary["top_ops"] if r["kind"] == "matmul"]
    assert len(matmuls) == 1 and matmuls[0]["kernels_per_step"] == 1
    assert matmuls[0]["shape"] == "f32[256,256]"
    assert 0 < summary["op_ms_per_step"] <= summary["span_ms_per_step"] * 2  # 2 cores at most
    assert f"python -m xformer.op_profile {run}" in caplog.text

    out = tmp_path / "summary.json"
    op_profile.main([str(tmp_path / "profile"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith(f"2 steps on the host plane of {trace}")
    assert f"| {matmuls[0]['op']} | matmul | f32[256,256] |" in printed
    assert json.loads(out.read_text())["top_ops"][0]["op"] == summary["top_ops"][0]["op"]


PROGRAM = """HloModule jit_train_step

%fused_split (param_0: f32[8,96]) -> (f32[8,32], f32[8,32], f32[8,32]) {
  %param_0 = f32[8,96]{1,0} parameter(0)
  %bitcast.1 = f32[8,96]{1,0} bitcast(%param_0)
  %slice.1 = f32[8,32]{1,0} slice(%bitcast.1), slice={[0:8], [0:32]}
  %slice.2 = f32[8,32]{1,0} slice(%bitcast.1), slice={[0:8], [32:64]}
  %slice.3 = f32[8,32]{1,0} slice(%param_0), slice={[0:8], [64:96]}
  ROOT %tuple.1 = (f32[8,32]{1,0}, f32[8,32]{1,0}, f32[8,32]{1,0}) tuple(%slice.1, %slice.2, %slice.3)
}

%fused_gemm (param_0.1: f32[8,32], param_1.1: f32[32,16]) -> f32[8,16] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  %param_1.1 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scale (param_0.2: f32[8,16]) -> f32[8,16] {
  %param_0.2 = f32[8,16]{1,0} parameter(0)
  ROOT %multiply.1 = f32[8,16]{1,0} multiply(%param_0.2, %param_0.2)
}

%body (loop: f32[8,16]) -> f32[8,16] {
  %loop = f32[8,16]{1,0} parameter(0)
  ROOT %loop_fusion = f32[8,16]{1,0} fusion(%loop), kind=kLoop, calls=%fused_scale
}

%cond (loop.1: f32[8,16]) -> pred[] {
  %loop.1 = f32[8,16]{1,0} parameter(0)
  ROOT %constant.1 = pred[] constant(true)
}

%cheap (branch: f32[8,16]) -> f32[8,16] {
  ROOT %branch = f32[8,16]{1,0} parameter(0)
}

%costly (branch.1: f32[8,16]) -> f32[8,16] {
  %branch.1 = f32[8,16]{1,0} parameter(0)
  ROOT %branch_fusion = f32[8,16]{1,0} fusion(%branch.1), kind=kLoop, calls=%fused_scale
}

ENTRY %main (p: f32[8,96], w: f32[32,16], flag: s32[]) -> f32[8,16] {
  %p = f32[8,96]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %flag = s32[] parameter(2)
  %split_fusion = (f32[8,32]{1,0}, f32[8,32]{1,0}, f32[8,32]{1,0}) fusion(%p), kind=kLoop, calls=%fused_split
  %q = f32[8,32]{1,0} get-tuple-element(%split_fusion), index=0
  %gemm_fusion = f32[8,16]{1,0} fusion(%q, %w), kind=kCustom, calls=%fused_gemm
  %while.1 = f32[8,16]{1,0} while(%gemm_fusion), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %conditional.1 = f32[8,16]{1,0} conditional(%flag, %while.1, %while.1), branch_computations={%cheap, %costly}
  %all-reduce-start = f32[8,16]{1,0} all-reduce-start(%conditional.1), replica_groups={}, to_apply=%fused_scale
  ROOT %all-reduce-done = f32[8,16]{1,0} all-reduce-done(%all-reduce-start)
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_kernels_and_floors_of_a_program():
    """What one run executes: the entry's kernels, a while body x its trip count, the costlier
    branch of a conditional, no bookkeeping ops and no async ends; a fusion that only slices
    its operand reads the slices; each floor is max(FLOPs / rate, bytes / bandwidth)."""
    f32 = 4
    runs = {op.name: times for op, times in op_profile.kernels(PROGRAM)}
    assert runs == {
        "split_fusion": 1,
        "gemm_fusion": 1,
        "loop_fusion": 3,
        "branch_fusion": 1,
        "all-reduce-start": 1,
    }
    ops = op_profile.parse_hlo(PROGRAM)
    assert ops["split_fusion"].bytes == 2 * 3 * 8 * 32 * f32  # three slices read, three written
    assert ops["gemm_fusion"].bytes == (8 * 32 + 32 * 16 + 8 * 16) * f32
    assert ops["gemm_fusion"].flops == 2 * 8 * 16 * 32
    assert ops["loop_fusion"].bytes == 2 * 8 * 16 * f32

    ran = op_profile.kernels(PROGRAM)
    summary = op_profile.floors(ran, flops_per_s=1e3, bytes_per_s=1e4, top=2)
    seconds = {
        "split_fusion": 2 * 768 * f32 / 1e4,
        "gemm_fusion": max(8192 / 1e3, 896 * f32 / 1e4),  # compute-bound
        "loop_fusion": 3 * 256 * f32 / 1e4,
        "branch_fusion": 256 * f32 / 1e4,
        "all-reduce-start": 256 * f32 / 1e4,
    }
    assert summary["kernels"] == 7
    assert summary["floor_ms"] == pytest.approx(1e3 * sum(seconds.values()))
    assert summary["compute_floor_ms"] == pytest.approx(1e3 * 8192 / 1e3)
    moved = sum(ops[name].bytes * n for name, n in runs.items())
    assert summary["gb"] == pytest.approx(moved / 1e9)
    assert [r["op"] for r in summary["top_ops"]] == ["gemm_fusion", "split_fusion"]
    assert sum(c["kernels"] for c in summary["categories"]) == 7
    text = op_profile.format_floors(summary)
    assert text.startswith("7 kernels a step") and "| gemm_fusion | matmul | f32[8,16] |" in text
    cheap = op_profile.kernels(PROGRAM, costliest=False)
    assert {op.name for op, _ in cheap} == set(runs) - {"branch_fusion"}
    cheap_floor = op_profile.floors(cheap, 1e3, 1e4)["floor_ms"]
    assert cheap_floor == pytest.approx(summary["floor_ms"] - 1e3 * seconds["branch_fusion"])


SCATTERS = """HloModule jit_train_step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_into_parameter (param_0: f32[8,1000], param_1: s32[8,2], param_2: f32[8]) -> f32[8,1000] {
  %param_0 = f32[8,1000]{1,0} parameter(0)
  %param_1 = s32[8,2]{1,0} parameter(1)
  %param_2 = f32[8]{0} parameter(2)
  ROOT %scatter.1 = f32[8,1000]{1,0} scatter(%param_0, %param_1, %param_2), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%add
}

%fused_into_zeros (param_0.1: s32[8,2], param_1.1: f32[8]) -> f32[8,1000] {
  %param_0.1 = s32[8,2]{1,0} parameter(0)
  %param_1.1 = f32[8]{0} parameter(1)
  %zero = f32[] constant(0)
  %zeros = f32[8,1000]{1,0} broadcast(%zero), dimensions={}
  ROOT %scatter.2 = f32[8,1000]{1,0} scatter(%zeros, %param_0.1, %param_1.1), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (x: f32[8,1000], i: s32[8,2], u: f32[8]) -> f32[8,1000] {
  %x = f32[8,1000]{1,0} parameter(0)
  %i = s32[8,2]{1,0} parameter(1)
  %u = f32[8]{0} parameter(2)
  %in_place = f32[8,1000]{1,0} fusion(%x, %i, %u), kind=kInput, calls=%fused_into_parameter
  %from_zeros = f32[8,1000]{1,0} fusion(%i, %u), kind=kInput, calls=%fused_into_zeros
  ROOT %plain = f32[8,1000]{1,0} scatter(%in_place, %i, %u), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%add
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_a_scatter_into_an_operand_moves_only_the_updated_elements():
    """A scatter (fused or not) into an operand updates that buffer in place: its bytes are
    the indices and updates read plus the updated elements read and written, not the
    [8, 1000] array; a fused scatter into zeros it makes itself writes the whole array."""
    ops = op_profile.parse_hlo(SCATTERS)
    indices, updates, array = 8 * 2 * 4, 8 * 4, 8 * 1000 * 4
    assert ops["in_place"].bytes == indices + updates + 2 * updates
    assert ops["plain"].bytes == indices + updates + 2 * updates
    assert ops["from_zeros"].bytes == indices + updates + array


COLLECTIVE_OPS = """HloModule jit_train_step

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

%all-reduce-scatter.1 (input_0: bf16[512,2,512], input_1: bf16[512,512]) -> (bf16[128,2,512], bf16[128,512]) {
  %input_0 = bf16[512,2,512]{2,0,1:T(8,128)(2,1)} parameter(0)
  %input_1 = bf16[512,512]{1,0:T(8,128)(2,1)} parameter(1)
  %all-reduce.7 = (bf16[512,2,512]{2,0,1:T(8,128)(2,1)}, bf16[512,512]{1,0:T(8,128)(2,1)}) all-reduce(%input_0, %input_1), channel_id=7, replica_groups={{0,1,2,3}}, to_apply=%add
  %gte.0 = bf16[512,2,512]{2,0,1:T(8,128)(2,1)} get-tuple-element(%all-reduce.7), index=0
  %gte.1 = bf16[512,512]{1,0:T(8,128)(2,1)} get-tuple-element(%all-reduce.7), index=1
  %s.0 = bf16[128,2,512]{2,0,1} slice(%gte.0), slice={[0:128], [0:2], [0:512]}
  %s.1 = bf16[128,512]{1,0} slice(%gte.1), slice={[0:128], [0:512]}
  ROOT %t = (bf16[128,2,512]{2,0,1}, bf16[128,512]{1,0}) tuple(%s.0, %s.1)
}

%gather-start.2 (p: bf16[128,512]) -> (bf16[128,512], bf16[512,512], u32[]) {
  %p = bf16[128,512]{1,0:T(8,128)(2,1)} parameter(0)
  %all-gather.2 = bf16[512,512]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
  %flag = u32[] constant(0)
  ROOT %t = (bf16[128,512]{1,0}, bf16[512,512]{1,0}, u32[]) tuple(%p, %all-gather.2, %flag)
}

%gather-and-dot.3 (p: bf16[128,512], q: bf16[512,512], x: f32[64,256]) -> (f32[64,256], bf16[128,512], bf16[512,512]) {
  %p = bf16[128,512]{1,0:T(8,128)(2,1)} parameter(0)
  %q = bf16[512,512]{1,0:T(8,128)(2,1)} parameter(1)
  %x = f32[64,256]{1,0} parameter(2)
  %all-gather.3 = bf16[512,512]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
  %d = f32[64,256]{1,0} dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %t = (f32[64,256]{1,0}, bf16[128,512]{1,0}, bf16[512,512]{1,0}) tuple(%d, %p, %all-gather.3)
}

ENTRY %main (w: bf16[512,2,512], v: bf16[512,512], x: f32[64,256], y: f32[16]) -> f32[64,1024] {
  %w = bf16[512,2,512]{2,0,1} parameter(0)
  %v = bf16[512,512]{1,0} parameter(1)
  %x = f32[64,256]{1,0} parameter(2)
  %y = f32[16]{0} parameter(3)
  %scatter = (bf16[128,2,512]{2,0,1}, bf16[128,512]{1,0}) fusion(%w, %v), kind=kCustom, calls=%all-reduce-scatter.1
  %w.shard = bf16[128,512]{1,0} slice(%v), slice={[0:128], [0:512]}
  %async-collective-start.2 = (bf16[128,512]{1,0}, bf16[512,512]{1,0}, u32[]) fusion(%w.shard), kind=kCustom, calls=%gather-start.2
  %gathering = (f32[64,256]{1,0}, bf16[128,512]{1,0}, bf16[512,512]{1,0}) fusion(%w.shard, %v, %x), kind=kCustom, calls=%gather-and-dot.3
  %all-gather-start = (f32[64,256]{1,0}, f32[64,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={1}
  %all-gather-done = f32[64,1024]{1,0} all-gather-done(%all-gather-start)
  %combined = (f32[16]{0}, f32[16]{0}) all-reduce(%y, %y), channel_id=7, replica_groups={{0,1,2,3}}, to_apply=%add
  %permute = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%y), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %permute-done = f32[16]{0} collective-permute-done(%permute)
  ROOT %out = f32[64,1024]{1,0} copy(%all-gather-done)
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_collectives_are_counted_wherever_they_are_with_their_results_bytes():
    """A combined (tuple) all-reduce, one inside a fusion (XLA:TPU's reduce-scatter), TPU tiled
    layouts, async pairs counted once by their results (not their operands or sync flags), and
    an all-gather that XLA:TPU cloned into a fusion advancing it beside a dot counted once, two
    all-reduces with one channel_id counted twice."""
    found = op_profile.collectives(COLLECTIVE_OPS)
    assert found.keys() == {"all-reduce", "all-gather", "collective-permute"}
    assert found["all-reduce"]["count"] == 2
    bf16, f32 = 2, 4
    assert found["all-reduce"]["gb"] * 1e9 == pytest.approx(
        (512 * 2 * 512 + 512 * 512) * bf16 + 2 * 16 * f32
    )
    gathered = 64 * 1024 * f32 + 512 * 512 * bf16
    assert found["all-gather"] == {"count": 2, "gb": pytest.approx(gathered / 1e9)}
    assert found["collective-permute"] == {"count": 1, "gb": pytest.approx(16 * f32 / 1e9)}


def test_self_times_nest_only_whole_enclosures():
    """A kernel that starts 0.1 us before the previous one ends (timestamps' rounding) is not
    inside it; a while thunk's body ops are, and leave the thunk its own time."""
    events = [("gemm", 0.0, 1000.0), ("reduce", 999.9, 500.0), ("while", 2000.0, 100.0)]
    events += [("body", 2010.0, 30.0), ("body.1", 2050.0, 40.0)]
    own = {name: t for name, _, t, _ in op_profile._self_times(events)}
    assert own == pytest.approx(
        {"gemm": 1000.0, "reduce": 500.0, "while": 30.0, "body": 30.0, "body.1": 40.0}
    )


TPU_COPIES = """HloModule jit_train_step

%branch_dense (p.1: bf16[64,128]) -> bf16[64,128] {
  %p.1 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %copy.9 = bf16[64,128]{0,1:T(8,128)(2,1)} copy(%p.1)
}

%branch_sparse (p.2: bf16[64,128]) -> bf16[64,128] {
  ROOT %p.2 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
}

%fused_transposed (param_0: f32[8,256,128]) -> f32[8,256,128] {
  %param_0 = f32[8,256,128]{2,1,0:T(8,128)} parameter(0)
  ROOT %copy.3 = f32[8,256,128]{1,2,0:T(8,128)} copy(%param_0)
}

ENTRY %main (a: f32[8,256,128], b: bf16[96,256,3,8,64], i: s32[]) -> f32[8,256,128] {
  %a = f32[8,256,128]{2,1,0:T(8,128)} parameter(0)
  %b = bf16[96,256,3,8,64]{4,3,2,1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[] parameter(2)
  %copy.1 = bf16[96,256,3,8,64]{4,1,3,0,2:T(8,128)(2,1)} copy(%b)
  %copy.2 = f32[8,256,128]{2,1,0:T(8,128)S(1)} copy(%a)
  %copy-start = (f32[8,256,128]{2,1,0:T(8,128)S(1)}, f32[8,256,128]{2,1,0:T(8,128)}, u32[]) copy-start(%a)
  %fusion = f32[8,256,128]{1,2,0:T(8,128)} fusion(%a), kind=kLoop, calls=%fused_transposed
  %slice = bf16[64,128]{1,0:T(8,128)(2,1)} slice(%b), slice={[0:1], [0:1], [0:1], [0:8], [0:64]}
  %conditional = bf16[64,128]{1,0:T(8,128)(2,1)} conditional(%i, %slice, %slice), branch_computations={%branch_dense, %branch_sparse}
  ROOT %copy.4 = f32[8,256,128]{1,2,0:T(8,128)} copy(%a)
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_layout_copies_count_the_hbm_copies_one_step_runs():
    """Two HBM layout copies of the entry computation count, each read and written; a copy
    into on-chip memory (S(1)), an async prefetch, a copy inside a fusion and one in the
    costlier branch of a conditional (the dense fallback) do not."""
    found = op_profile.layout_copies(TPU_COPIES)
    bf16, f32 = 2, 4
    moved = 2 * (96 * 256 * 3 * 8 * 64 * bf16 + 8 * 256 * 128 * f32)
    assert found == {"count": 2, "gb": pytest.approx(moved / 1e9)}
