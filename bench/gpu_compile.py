"""The train step as XLA compiles it for a GPU, on a machine without one: its kernels, copies,
cuDNN attention calls, memory, and a roofline floor of its step time.

    python bench/gpu_compile.py                                    # wmt14, bf16, fused, H100
    python bench/gpu_compile.py --configs wmt14,ptb_xl,wt103_xl --impl fused,xla --top 30

It needs JAX's CUDA plugin (no GPU, driver or CUDA install: the NVIDIA wheels, ~3 GB), e.g. in
a virtual environment beside the project's:

    python -m venv --system-site-packages /tmp/gpu_compile && /tmp/gpu_compile/bin/pip install \\
        "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"
    JAX_PLATFORMS=cpu /tmp/gpu_compile/bin/python bench/gpu_compile.py

The GPU is described by a GpuTargetConfigProto text file (`--target`; bench/h100_sxm.txtpb,
from XLA's own H100 SXM description; `bash bench/gpu_session.sh facts` saves the lent
machine's as target_config.txtpb). JAX makes compile-only devices of it
(`jax.experimental.topologies.get_topology_desc`), and the step of bench/gpu_throughput.py
(real configs, synthetic batches, state donated) is lowered onto them and compiled. The
attention module picks cuDNN by `jax.default_backend()`, which is "cpu" here, so it is told
"gpu" while the step is traced. It compiles as train.py's does (`train_lib.compile_step`: no
Triton GEMM fusions on a GPU), so every GEMM goes to cuBLAS with the epilogues XLA fuses into
it; XLA_FLAGS=--xla_gpu_enable_triton_gemm=true shows XLA's own default instead, with Triton
tilings that are untuned without a device (ptb_xl's then fails to compile). The rest, the
kernels around the GEMMs, the copies, the cuDNN calls and the buffers, are what the GPU
compiler makes of the program.

Reported per setting (of each conditional, the costliest branch counts; `--cheapest-branch`
the other way): compile time; kernels a step by kind; copies (count, GB); cuDNN
attention calls; XLA's memory analysis (arguments + outputs - donated + temporaries: the
step's peak, as bench/gpu_throughput.py reports it); and `op_profile.floors`: each kernel's
floor max(FLOPs / peak, bytes / bandwidth) summed by category, with the top kernels. The
bytes are each kernel's operands and results (what it must read and write at least, L2 hits
aside), the peak the device's dense bf16 rate (xformer/flops.py's PEAK_TFLOPS) and the bandwidth
the target's. The floor bounds MFU from above: analytic FLOPs / floor / peak.
"""

import argparse
import collections
import contextlib
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from unittest import mock

import gpu_throughput as gt

HERE = os.path.dirname(os.path.abspath(__file__))
# The results of cuDNN's attention backward calls: (dq, dk, dv, [dbias,] workspace).
CUDNN_BACKWARD = re.compile(r"= \(([^)]*)\) custom-call\([^\n]*__cudnn\$fmha\w*Backward")


def settings(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(model, dtype, attention_impl) of every combination of --configs, --dtype and --impl."""
    return itertools.product(*(getattr(args, k).split(",") for k in ("configs", "dtype", "impl")))


def compile_only_mesh(target: str):
    """A mesh of one compile-only GPU described by the target config text."""
    from jax.experimental import topologies

    from xformer import sharding

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target, topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as error:
        raise SystemExit(
            f"no compile-only CUDA devices ({error}); install jax-cuda12-plugin[with-cuda] of "
            "this jax's version (see this script's docstring)"
        ) from error
    return sharding.make_mesh({}, topology.devices[:1])


def compile_step(
    name: str, dtype: str, impl: str, overrides: dict, mesh, backend: str = "gpu"
) -> tuple:
    """(compiled train step, config, vocabulary size, seconds to compile) of one setting, traced
    as if `jax.default_backend()` were `backend` (the platform of the mesh's devices)."""
    import jax

    from xformer import train_lib

    config, vocab = gt.load_config(name, False, dtype, impl, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        task = gt.make_task(config, vocab, workdir)
        host_batch = gt.synthetic_batches(config, vocab, 1)[0]
        carry = task.init_carry()  # on the CPU: only its shapes are used
        task.exp = exp = task.exp.on_mesh(mesh)
        on = lambda where: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)  # noqa: E731
        state = {**exp.abstract_state(), "carry": jax.tree.map(on(exp.batch_sharding), carry)}
        rng_state = jax.tree.map(on(exp.replicated), exp.rng_state)
        batch = jax.tree.map(on(exp.batch_sharding), host_batch)
        platform = mesh.devices.flat[0].platform
        start = time.perf_counter()
        with mock.patch.object(jax, "default_backend", lambda: backend), _target_capability(mesh):
            lowered = train_lib.lower_train_step(task, state, rng_state, batch, platform)
        compiled = train_lib.compile_step(lowered, platform)
    return compiled, config, vocab, time.perf_counter() - start


@contextlib.contextmanager
def _target_capability(mesh) -> Iterator[None]:
    """jax's cuDNN module asks the local GPU's compute capability (e.g. cuDNN's packed layout
    needs Hopper); there is none here, so it is told the compile-only device's."""
    device = mesh.devices.flat[0]
    if not hasattr(device, "compute_capability"):
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    target = version(device.compute_capability)
    with (
        mock.patch.object(cudnn, "check_compute_capability", lambda c: target >= version(c)),
        mock.patch.object(
            cudnn, "is_cuda_compute_capability_equal", lambda c: target == version(c)
        ),
    ):
        yield


def census(ops: list, hlo: str) -> dict:
    """Kernels by kind, copies and cuDNN attention calls of `op_profile.kernels`."""
    kinds = collections.Counter(op.kind for op, _ in ops)
    copies = [(op, n) for op, n in ops if op.opcode == "copy"]
    return {
        "kernels": sum(n for _, n in ops),
        "by_kind": dict(kinds.most_common()),
        "copies": sum(n for _, n in copies),
        "copy_gb": sum(op.bytes * n for op, n in copies) / 1e9,
        "cudnn_attention_calls": len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo)),
        "cudnn_bias_gradients": sum(r.count("[") == 5 for r in CUDNN_BACKWARD.findall(hlo)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="wmt14", help=f"of {list(gt.MODELS)}")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype(s), comma-separated")
    parser.add_argument("--impl", default="fused", help="model.attention_impl(s)")
    parser.add_argument("--target", default=os.path.join(HERE, "h100_sxm.txtpb"))
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="default: by device")
    parser.add_argument("--set", action="append", default=[], help="[model:]key=value")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by floor")
    parser.add_argument(
        "--cheapest-branch",
        action="store_true",
        help="count each conditional's cheapest branch, not its costliest (e.g. wt103_xl's "
        "adaptive softmax: the sparse path, not the capacity overflow's dense fallback)",
    )
    parser.add_argument("--hlo-dir", help="save each setting's optimized HLO here")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from bench_output import command_line

    from xformer import op_profile

    print("command:", command_line(), flush=True)
    with open(args.target) as f:
        target = f.read()
    mesh = compile_only_mesh(target)
    device = mesh.devices.flat[0].device_kind
    peak, peak_source = gt.peak_tflops(device, args.peak_tflops)
    bandwidth = float(re.search(r"memory_bandwidth: (\d+)", target)[1])
    print(
        f"target: {device} ({args.target}), jax {jax.__version__}; peak {peak} TFLOP/s "
        f"({peak_source}), {bandwidth / 1e12:.2f} TB/s",
        flush=True,
    )
    overrides = gt.parse_overrides(args.set)
    results = []
    for name, dtype, impl in settings(args):
        compiled, config, vocab, seconds = compile_step(name, dtype, impl, overrides[name], mesh)
        hlo = compiled.as_text()
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"{name}_{dtype}_{impl}.hlo"), "w") as f:
                f.write(hlo)
        memory = compiled.memory_analysis()
        step_bytes = gt.compiled_step_bytes(compiled)
        ops = op_profile.kernels(hlo, costliest=not args.cheapest_branch)
        floors = op_profile.floors(ops, peak * 1e12, bandwidth, top=args.top)
        analytic = gt.model_flops(config, vocab).total
        result = {
            "model": name,
            "dtype": dtype,
            "attention_impl": impl,
            "compile_s": seconds,
            **census(ops, hlo),
            "step_gib": step_bytes / 2**30,
            "temp_gib": memory.temp_size_in_bytes / 2**30,
            "flops_analytic": analytic,
            "mfu_bound": analytic / (floors["floor_ms"] * 1e-3) / (peak * 1e12),
            "floors": floors,
        }
        results.append(result)
        print(
            f"\n## {name} {dtype} {impl}: compiled in {seconds:.0f} s; "
            f"{result['kernels']:,.0f} kernels {result['by_kind']}; "
            f"{result['copies']:,.0f} copies ({result['copy_gb']:.2f} GB); "
            f"{result['cudnn_attention_calls']} cuDNN attention calls "
            f"({result['cudnn_bias_gradients']} backward with a bias gradient); "
            f"step memory "
            f"{result['step_gib']:.2f} GiB ({result['temp_gib']:.2f} temporaries); "
            f"{analytic / 1e12:.2f} TFLOP analytic: MFU <= {result['mfu_bound']:.1%}\n",
            flush=True,
        )
        print(op_profile.format_floors(floors), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
