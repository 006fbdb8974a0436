"""The train step compiled for a TPU slice, on a machine without one: does it compile, does it
fit in each chip's memory, and what does the sharded program communicate.

    python -m venv --system-site-packages /tmp/tpu_compile && /tmp/tpu_compile/bin/pip install \\
        "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"     # libtpu, ~140 MB
    JAX_PLATFORMS=cpu /tmp/tpu_compile/bin/python bench/tpu_compile.py   # wmt14 on one v5e chip
    JAX_PLATFORMS=cpu /tmp/tpu_compile/bin/python bench/tpu_compile.py \\
        --mesh 1,4,1 --configs wmt14,ptb_xl,wt103_xl
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/tpu_compile.py \\
        --topology cpu --mesh 1,1,4 --dtype float32 --impl xla       # tensor=4, on CPU devices

libtpu describes any TPU slice by name (`jax.experimental.topologies.get_topology_desc`); the
step of bench/gpu_throughput.py (real configs, synthetic batches, state donated) is lowered onto
its compile-only devices over the (data, fsdp, tensor) mesh `--mesh` and compiled by the TPU
compiler. No TPU runs anything, so no time is measured. Reported per setting: compile time,
each chip's step memory (XLA's memory analysis: arguments + outputs - donated + temporaries)
against the chip's HBM, XLA's FLOP count per chip and the time it would take at the chip's
dense bfloat16 peak (a floor that leaves out memory traffic), the Pallas kernel calls (splash
attention), the layout copies one step runs (`op_profile.layout_copies`: HBM passes that only
change an array's tiling or dimension order) and the collectives the SPMD partitioner inserted
(count and bytes of each kind).
The attention module picks its backend by `jax.default_backend()`, "cpu" here, so it is told
"tpu" while the step is traced: fused attention takes the splash kernel where it serves
(xformer/splash_attention.py) and jax.nn.dot_product_attention's XLA implementation elsewhere,
as on a TPU.
"""

import argparse
import json
import os

import gpu_compile
import gpu_throughput as gt
import numpy as np

HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95}
HBM_GIB |= {"TPU v6 lite": 32, "TPU v6e": 32}


def compile_only_mesh(topology_name: str, mesh_sizes: tuple[int, ...]):
    """A (data, fsdp, tensor) mesh over compile-only chips of the named TPU slice ("cpu": this
    host's CPU devices): all of them if a size is -1, else its first data x fsdp x tensor."""
    import jax
    from jax.experimental import topologies

    from xformer import sharding

    if topology_name == "cpu":
        devices = jax.devices("cpu")
    else:
        try:
            topology = topologies.get_topology_desc(topology_name=topology_name, platform="tpu")
        except (NotImplementedError, RuntimeError, ValueError) as error:
            raise SystemExit(
                f"no compile-only TPU devices for {topology_name!r} ({error}); install "
                "jax[tpu] of this jax's version (see this script's docstring)"
            ) from error
        devices = topology.devices
    if -1 not in mesh_sizes:  # the first chips of the slice
        devices = devices[: int(np.prod(mesh_sizes))]
    return sharding.make_mesh(dict(zip(sharding.MESH_AXES, mesh_sizes, strict=True)), devices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="wmt14", help=f"of {list(gt.MODELS)}")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype(s), comma-separated")
    parser.add_argument("--impl", default="fused", help="model.attention_impl(s)")
    parser.add_argument(
        "--topology",
        default="v5e:2x2",
        help="e.g. v4:2x2x1, v5e:2x4, v6e:4x4; cpu: this host's CPU devices (the same SPMD "
        "partitioner; XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)",
    )
    parser.add_argument(
        "--mesh", default="1,1,1", help="data,fsdp,tensor sizes (-1: the slice's other chips)"
    )
    parser.add_argument("--set", action="append", default=[], help="[model:]key=value")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--hlo-dir", help="save each setting's optimized HLO here")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from bench_output import command_line

    from xformer import op_profile, sharding

    print("command:", command_line(), flush=True)
    mesh = compile_only_mesh(args.topology, tuple(sharding.parse_mesh(args.mesh).values()))
    chips = mesh.devices.size
    device = mesh.devices.flat[0].device_kind
    peak, _ = gt.peak_tflops(device, 0.0)
    hbm = HBM_GIB.get(device)
    print(
        f"target: {args.topology}, {chips} x {device} (peak {peak} TFLOP/s, HBM {hbm} GiB), "
        f"mesh {dict(mesh.shape)}, jax {jax.__version__}",
        flush=True,
    )
    overrides = gt.parse_overrides(args.set)
    results = []
    for name, dtype, impl in gpu_compile.settings(args):
        compiled, config, vocab, seconds = gpu_compile.compile_step(
            name, dtype, impl, overrides[name], mesh, backend=mesh.devices.flat[0].platform
        )
        hlo = compiled.as_text()
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            sizes = "x".join(str(n) for n in mesh.shape.values())
            with open(os.path.join(args.hlo_dir, f"{name}_{dtype}_{impl}_{sizes}.hlo"), "w") as f:
                f.write(hlo)
        step_gib = gt.compiled_step_bytes(compiled) / 2**30
        flops = (compiled.cost_analysis() or {}).get("flops", 0.0)
        analytic = gt.model_flops(config, vocab).total
        result = {
            "model": name,
            "dtype": dtype,
            "attention_impl": impl,
            "topology": args.topology,
            "mesh": dict(mesh.shape),
            "device": device,
            "compile_s": seconds,
            "step_gib_per_chip": step_gib,
            "temp_gib_per_chip": compiled.memory_analysis().temp_size_in_bytes / 2**30,
            "hbm_gib": hbm,
            "xla_tflop_per_chip": flops / 1e12,
            "analytic_tflop": analytic / 1e12,
            "flop_floor_ms": flops / (peak * 1e12) * 1e3 if peak else None,
            "collectives": op_profile.collectives(hlo),
            "pallas_calls": hlo.count('custom_call_target="tpu_custom_call"'),
            "layout_copies": op_profile.layout_copies(hlo),
        }
        results.append(result)
        fits = "" if hbm is None else f" of {hbm} GiB ({step_gib / hbm:.0%})"
        comms = ", ".join(
            f"{c['count']} {kind} ({c['gb']:.2f} GB)"
            for kind, c in sorted(result["collectives"].items())
        )
        print(
            f"{name} {dtype} {impl}: compiled in {seconds:.0f} s; step memory "
            f"{step_gib:.2f} GiB per chip{fits}; XLA {flops / 1e12:.2f} TFLOP per chip "
            f"(analytic {analytic / 1e12:.2f} in all), "
            f"{result['flop_floor_ms'] or float('nan'):.1f} ms at peak; "
            f"{result['pallas_calls']} Pallas calls; {result['layout_copies']['count']:.0f} layout "
            f"copies ({result['layout_copies']['gb']:.2f} GB); collectives: {comms or 'none'}",
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
