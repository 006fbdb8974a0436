"""Where a traced program's time goes: its XLA ops ranked by time and summed by category.

Reads a jax.profiler trace (`<host>.xplane.pb`, as `train.profile_steps` or
`jax.profiler.trace` writes it) and the program's optimized HLO text (`compiled.as_text()`;
`train.profile_steps` saves it beside the trace as `train_step.hlo.txt`). Every trace event
that carries the `hlo_op` and `hlo_module` stats of the program counts: on a GPU, the kernels
on the device's streams (an HLO op may launch several); on CPU, XLA:CPU's thunks. Each op's
kind (matmul, fused attention, collective, transpose, reduce, elementwise, control flow), shape
and innermost user source line come from the HLO's metadata, and two rates from its shapes:
GB/s of the bytes at its boundary (operands read and result written once: compare with the
device's copy bandwidth, `bench/matmul_ceiling.py --copy_gib`) and, for matmuls, GFLOP/s
(compare with the matmul ceiling).

    python -m xformer.op_profile <workdir>/profile          # the newest trace under it
    python -m xformer.op_profile <run folder> --top 40 --json summary.json

Without a trace, `kernels` lists the ops one run of a program executes and `floors` bounds
their time from below, each at max(FLOPs / peak rate, bytes / bandwidth), by the same
categories (bench/gpu_compile.py: a GPU program compiled on a machine without a GPU).

Caveats: XLA:CPU runs independent thunks concurrently and Eigen dots finish asynchronously, so
single CPU ops can be mis-timed while totals stay close to the wall time. On a GPU, kernels
that run inside a CUDA graph are attributed to the graph's command-buffer op; set
`XLA_FLAGS=--xla_gpu_enable_command_buffer=` for a per-op profile (the summary reports how much
device time no op of the program claims).
"""

import argparse
import collections
import dataclasses
import glob
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable

HLO_FILE = "train_step.hlo.txt"  # written by train_lib.StepProfiler beside the trace
STEP_ANNOTATION = "train"  # train.py's jax.profiler.StepTraceAnnotation name
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction of optimized HLO, as the profile needs it."""

    name: str
    opcode: str
    kind: str  # matmul, fused attention, collective, transpose, reduce, elementwise, control flow
    shape: str  # the result shape, e.g. "f32[2048,256]"
    shapes: str  # every shape in the op and its fused body (for shape-based categories)
    source: str  # innermost user frame "path:function:line", path relative to the package
    op_name: str  # jax's op name path, e.g. "jit(train_step)/transpose(jvp())/dot_general"
    bytes: int = 0  # its result's size and its operands' (only the parts a fusion slices out)
    flops: int = 0  # 2 x multiply-adds of its matmuls (dots, GEMM custom calls)
    computation: str = ""  # the computation holding it (ENTRY's name for the program's own ops)
    chain: str = ""  # an async collective of XLA:TPU's: its channel_id and chain_id


def _frames(hlo: str) -> dict[int, str]:
    """The StackFrames table of HLO text: frame id -> "file:function:line" of the innermost
    frame of the project's own code on its stack (else the innermost frame): a cast inside
    flax's `promote_dtype` counts where xformer's layer called it, as older flax versions,
    whose frames jax left out, had it."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section, tables[line] = line, {}
        elif section and re.match(r"^\d+ ", line):
            key, value = line.split(" ", 1)
            tables[section][int(key)] = value.strip('"')
        else:
            section = None
    located, parents = {}, {}
    for fid, text in tables.get("StackFrames", {}).items():
        loc = tables["FileLocations"][int(re.search(r"file_location_id=(\d+)", text)[1])]
        file_id, func_id, lineno = (
            int(re.search(rf"{k}=(\d+)", loc)[1])
            for k in ("file_name_id", "function_name_id", "line")
        )
        path = tables["FileNames"][file_id]
        in_package = path.rsplit("/xformer/", 1)[-1] if "/xformer/" in path else None
        ours = "-packages/" not in (in_package or path)  # not an installed library's
        path = in_package or os.path.basename(path)
        located[fid] = (f"{path}:{tables['FunctionNames'][func_id]}:{lineno}", ours)
        parents[fid] = int(re.search(r"parent_frame_id=(\d+)", text)[1]) - 1  # printed + 1
    frames = {}
    for fid, (innermost, _) in located.items():
        frame, seen = fid, set()
        while frame in located and frame not in seen and not located[frame][1]:
            seen.add(frame)
            frame = parents[frame]
        frames[fid] = located[frame][0] if frame in located else innermost
    return frames


def _kind(opcode: str, target: str, body_opcodes: set[str]) -> str:
    if opcode in ("while", "conditional", "call"):
        return "control flow"  # its own time only: the ops of its body are timed apart
    opcodes = body_opcodes | {opcode}
    if "fmha" in target:  # cuDNN fused attention (`__cudnn$fmha...`)
        return "fused attention"
    if opcodes & {"dot", "convolution"} or re.search(r"gemm|matmul", target):
        return "matmul"  # XLA dots and fusions holding one; cuBLAS custom calls
    if any(op.removesuffix("-start").removesuffix("-done") in COLLECTIVES for op in opcodes):
        return "collective"
    if "transpose" in opcodes or opcode == "copy":
        return "transpose"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduce"
    return "elementwise"


def _bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape ("f32[2,3]", "(bf16[4], s8[16])"): 1 for pred."""
    total = 0
    for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
        bits = re.search(r"\d+", dtype)
        size = 1 if dtype == "pred" or not bits else max(int(bits[0]) // 8, 1)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _written(opcode: str, shape: str) -> int:
    """Bytes of an op's result. A custom call's scratch space (cuBLAS and cuDNN calls return
    it as the last element of their tuple, s8[n] or u8[n]) is not data it must write."""
    if opcode == "custom-call":
        shape = re.sub(r",\s*[su]8\[\d*\]\)$", ")", shape)
    return _bytes(shape)


def _dims(shape: str) -> list[int]:
    """The dimensions of the first array of a shape."""
    dims = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in dims[1].split(",") if d] if dims else []


def _operands(opcode: str, line: str) -> list[str]:
    args = re.search(rf" {re.escape(opcode)}\(([^)]*)\)", line)
    return re.findall(r"%([\w.\-]+)", args[1]) if args else []


def _dot_flops(line: str, opcode: str, shape: str, shapes: dict[str, str]) -> int:
    """2 x output elements x contracted size, for a dot or a cuBLAS/cuDNN GEMM custom call."""
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line) or re.search(
        r'"lhs_contracting_dimensions":\[([^\]]*)\]', line
    )
    operands = _operands(opcode, line)
    if not contracting or not operands or operands[0] not in shapes:
        return 0
    lhs = _dims(shapes[operands[0]])
    contracted = math.prod(lhs[int(d.strip('" '))] for d in contracting[1].split(",") if d)
    return 2 * math.prod(_dims(shape)) * contracted


def parse_hlo(hlo: str) -> dict[str, Op]:
    """Optimized HLO text -> {instruction name: Op} for every instruction of every computation
    (a fusion's kind and FLOPs look inside the computation it calls)."""
    frames = _frames(hlo)
    rows, bodies, current = [], collections.defaultdict(list), None
    shapes: dict[str, str] = {}  # every instruction's result shape, by name
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = head[1]
            continue
        m = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
        if m and current is not None:
            shape = re.sub(r"\{[^}]*\}", "", m[2])  # layouts and tiling dropped
            shapes[m[1]] = shape
            bodies[current].append((m[1], m[3], shape, line))
            rows.append((m[1], shape, m[3], line, current))
    ops = {}
    for name, shape, opcode, line, computation in rows:
        called = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", line)
        body = bodies.get(called[1], []) if called else []
        target = re.search(r'custom_call_target="([^"]*)"', line)
        kind = _kind(opcode, target[1] if target else "", {o for _, o, _, _ in body})
        flops = 0
        if kind == "matmul":
            parts = [(o, s, b) for _, o, s, b in body if o == "dot"] or [(opcode, shape, line)]
            flops = sum(_dot_flops(b, o, s, shapes) for o, s, b in parts)
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        chain = re.search(r'chain_id="(\d+)"', line)
        channel = re.search(r"channel_id=(\d+)", line)
        ops[name] = Op(
            name=name,
            opcode=opcode,
            kind=kind,
            shape=shape,
            shapes=" ".join([shape, *(s for _, _, s, _ in body)]),
            source=frames.get(int(frame[1]), "") if frame else "",
            op_name=op_name[1] if op_name else "",
            bytes=0 if kind == "control flow" else _moved(opcode, shape, line, body, shapes),
            flops=flops,
            computation=computation,
            chain=f"{channel[1] if channel else ''}:{chain[1]}" if chain else "",
        )
    return ops


def collective_ops(hlo: str) -> list[Op]:
    """The collective instructions of an optimized HLO, wherever they are (XLA:TPU puts its
    reduce-scatters in fusions), each once: a loop body's once, an async start/done pair by its
    start, and an XLA:TPU async collective once (it is cloned into its start, its done and every
    fusion that advances it beside other work, each clone with the same channel_id and
    chain_id; distinct collectives may share a channel_id)."""
    found, chains = [], set()
    for op in parse_hlo(hlo).values():
        if op.opcode.removesuffix("-start") not in COLLECTIVES or op.chain in chains:
            continue
        found.append(op)
        if op.chain:
            chains.add(op.chain)
    return found


def collectives(hlo: str) -> dict[str, dict]:
    """{kind: {"count", "gb"}} of `collective_ops`, with the GB of their results: what each
    device receives."""
    found: dict[str, dict] = {}
    for op in collective_ops(hlo):
        arrays = re.findall(r"[a-z]\w*\[[\d,]*\]", op.shape)
        if op.opcode in ("all-gather-start", "collective-permute-start"):
            arrays = arrays[1:2]  # (operand, result, ...): the result
        entry = found.setdefault(op.opcode.removesuffix("-start"), {"count": 0, "gb": 0.0})
        entry["count"] += 1
        entry["gb"] += sum(_bytes(a) for a in arrays) / 1e9
    return found


def layout_copies(hlo: str) -> dict:
    """{"count", "gb"} of the HBM-to-HBM `copy` ops one run of an optimized XLA:TPU program
    executes (`kernels`, a conditional's cheapest branch): layout changes (another tiling or
    dimension order), each reading and writing its array. Copies into another memory space (a
    layout with S(n): prefetches into on-chip memory) are left out."""
    layouts = dict(re.findall(r"%([\w.\-]+) = \w+\[[\d,]*\]\{([^}]*)\} copy\(", hlo))
    count, moved = 0.0, 0.0
    for op, times in kernels(hlo, costliest=False):
        if op.opcode == "copy" and "S(" not in layouts.get(op.name, "S("):
            count, moved = count + times, moved + times * 2 * _bytes(op.shape)
    return {"count": count, "gb": moved / 1e9}


SLICES = ("slice", "dynamic-slice", "gather")
VIEWS = ("bitcast", "reshape", "convert")  # element for element: slicing one reads as little


def _parameters(body: list[tuple]) -> dict[str, int]:
    """A fused computation's parameters: name -> parameter number (= the fusion's operand)."""
    return {
        name: int(re.search(r"parameter\((\d+)\)", text)[1])
        for name, op, _, text in body
        if op == "parameter"
    }


def _moved(opcode: str, shape: str, line: str, body: list[tuple], shapes: dict[str, str]) -> int:
    """Bytes an op reads and writes. A scatter into an operand (a fused scatter's, into one of
    the fusion's parameters) updates that buffer in place: it reads and writes the elements
    it updates, not the whole array (XLA:GPU gives the result the operand's buffer)."""
    fused = opcode == "fusion"
    root = next((b for b in body if fused and b[3].lstrip().startswith("ROOT ")), None)
    scatter = (root[1], root[3]) if root else (opcode, line)
    if scatter[0] == "scatter":
        target, _, updates = _operands("scatter", scatter[1])[:3]
        aliased = _parameters(body).get(target) if fused else 0
        if aliased is not None:
            touched = 2 * _bytes(shapes.get(updates, ""))
            return touched + _read(opcode, line, body, shapes, skip=frozenset({aliased}))
    return _written(opcode, shape) + _read(opcode, line, body, shapes)


def _read(
    opcode: str,
    line: str,
    body: list[tuple],
    shapes: dict[str, str],
    skip: frozenset[int] = frozenset(),
) -> int:
    """Bytes of an op's operands (but those numbered in skip); of a fused parameter that the
    fusion only slices or gathers from (also through VIEWS), the slices' (q, k and v cut from
    one projection: a third each)."""
    users = collections.defaultdict(list)  # name -> [(opcode, shape, name)] in the fused body
    params = {number: name for name, number in _parameters(body).items()}
    for name, op, shape, text in body:
        for operand in _operands(op, text):
            users[operand].append((op, shape, name))

    def sliced(name: str) -> int | None:
        """Bytes read from `name` if only slices read it, else None."""
        total = 0
        for op, shape, user in users[name]:
            part = sliced(user) if op in VIEWS else _bytes(shape) if op in SLICES else None
            if part is None:
                return None
            total += part
        return total if users[name] else None

    total = 0
    for i, operand in enumerate(_operands(opcode, line)):
        if i in skip:
            continue
        part = sliced(params[i]) if i in params else None
        total += _bytes(shapes.get(operand, "")) if part is None else part
    return total


def _from_package(*files: str) -> Callable[[Op], bool]:
    return lambda op: op.source.startswith(files)


_attention = _from_package("attention", "positional")
Category = tuple[str, Callable[[Op], bool]]
CATEGORIES: tuple[Category, ...] = (  # first match wins
    ("fused attention (cuDNN)", lambda op: op.kind == "fused attention"),
    ("matmul: attention scores, values", lambda op: op.kind == "matmul" and _attention(op)),
    ("matmul: dense layers", lambda op: op.kind == "matmul"),
    ("collectives", lambda op: op.kind == "collective"),
    ("layout transposes / copies", lambda op: op.kind == "transpose"),
    ("embeddings", lambda op: any(s in op.source for s in ("_embed", "embedding", ":Embed."))),
    (  # precision.add_bias: the biases' casts and gradients (layers and the adaptive softmax)
        "dense layers: bias, activation",
        _from_package(
            "linear.py", "blocks.py:FeedForward", "precision.py:_add_bias", "precision.py:add_bias"
        ),
    ),
    ("loss", _from_package("losses.py", "adaptive.py")),
    ("dropout", _from_package("dropout.py")),
    ("attention softmax, masks, positions", _from_package("attention", "masks", "positional")),
    ("LayerNorm, residual", lambda op: "Residual" in op.source or "norm" in op.source.lower()),
    ("optimizer", lambda op: op.source.startswith("train_lib.py") or "optax" in op.op_name),
    ("other", lambda op: True),
)


NO_KERNEL = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all")


def kernels(
    hlo: str, ops: dict[str, Op] | None = None, *, costliest: bool = True
) -> list[tuple[Op, float]]:
    """The ops one run of the program executes, each with how many times it runs: the entry
    computation's, those of while bodies (x their known trip count, else once) and of one
    branch of each conditional, the costliest by bytes + FLOPs (else the cheapest: e.g. when
    the costly branch is a fallback that rarely runs). Bookkeeping ops (parameter, tuple,
    bitcast, ...) and the ends of async pairs are left out."""
    ops = ops if ops is not None else parse_hlo(hlo)
    by_computation = collections.defaultdict(list)
    for op in ops.values():
        by_computation[op.computation].append(op)
    entry = re.search(r"^ENTRY %([\w.\-]+) ", hlo, re.M)
    lines = {m[1]: m[0] for m in re.finditer(r"^\s+(?:ROOT )?%([\w.\-]+) = .*$", hlo, re.M)}

    def walk(computation: str, times: float) -> list[tuple[Op, float]]:
        out = []
        for op in by_computation.get(computation, []):
            line = lines.get(op.name, "")
            if op.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = times * (int(trips[1]) if trips else 1)
                for key in ("body", "condition"):
                    called = re.search(rf"{key}=%([\w.\-]+)", line)
                    out += walk(called[1], n) if called else []
            elif op.opcode == "conditional":
                names = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = re.findall(r"%([\w.\-]+)", names[1] if names else line.split("),")[-1])
                branches = [walk(b, times) for b in names if b in by_computation]
                pick = max if costliest else min
                cost = lambda k: sum((o.bytes + o.flops) * t for o, t in k)  # noqa: E731
                out += pick(branches, key=cost) if branches else []
            elif op.opcode not in NO_KERNEL and not op.opcode.endswith("-done"):
                out.append((op, times))
        return out

    return walk(entry[1], 1.0) if entry else []


def floors(
    ran: list[tuple[Op, float]],
    flops_per_s: float,
    bytes_per_s: float,
    *,
    categories: Iterable[Category] = CATEGORIES,
    top: int = 20,
) -> dict:
    """A roofline of a compiled program without running it: each kernel of `ran` (`kernels`)
    gets the floor max(FLOPs / flops_per_s, bytes / bytes_per_s), summed per step, by category
    and ranked. A floor, not a forecast: real kernels miss both peaks, launches cost time, and
    a fused attention call's FLOPs are not counted (its floor is its bytes)."""
    categories = tuple(categories)
    by_category = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    rows = []
    for op, times in ran:
        floor = times * max(op.flops / flops_per_s, op.bytes / bytes_per_s)
        category = next(label for label, test in categories if test(op))
        for i, value in enumerate((times, times * op.bytes, times * op.flops, floor)):
            by_category[category][i] += value
        rows.append(
            {
                "op": op.name,
                "kind": op.kind,
                "category": category,
                "shape": op.shape,
                "source": op.source,
                "runs": times,
                "gb": times * op.bytes / 1e9,
                "gflop": times * op.flops / 1e9,
                "floor_ms": 1e3 * floor,
            }
        )
    rows.sort(key=lambda r: -r["floor_ms"])
    out = [
        {"category": c, "kernels": k, "gb": b / 1e9, "gflop": f / 1e9, "floor_ms": 1e3 * t}
        for c, (k, b, f, t) in sorted(by_category.items(), key=lambda kv: -kv[1][3])
    ]
    total = [sum(r[key] for r in out) for key in ("kernels", "gb", "gflop", "floor_ms")]
    return {
        "kernels": total[0],
        "gb": total[1],
        "gflop": total[2],
        "floor_ms": total[3],
        "compute_floor_ms": 1e3 * total[2] * 1e9 / flops_per_s,
        "memory_floor_ms": 1e3 * total[1] * 1e9 / bytes_per_s,
        "categories": out,
        "top_ops": rows[:top],
    }


def format_floors(summary: dict) -> str:
    """Markdown: a header line, the category table and the top kernels."""
    lines = [
        f"{summary['kernels']:,.0f} kernels a step, {summary['gb']:,.1f} GB at their boundaries, "
        f"{summary['gflop']:,.0f} GFLOP in matmuls: floor {summary['floor_ms']:.2f} ms "
        f"(matmuls alone at peak {summary['compute_floor_ms']:.2f} ms, every byte at peak "
        f"bandwidth {summary['memory_floor_ms']:.2f} ms)",
        "",
        "| category | kernels | GB | GFLOP | floor ms |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['category']} | {r['kernels']:,.0f} | {r['gb']:,.2f} | {r['gflop']:,.0f} | "
        f"{r['floor_ms']:.2f} |"
        for r in summary["categories"]
    ]
    lines += [
        "",
        "| op | kind | shape | source (innermost) | runs | GB | GFLOP | floor ms |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['op']} | {r['kind']} | {r['shape'][:60]} | {r['source']} | {r['runs']:g} | "
        f"{r['gb']:.3f} | {r['gflop']:,.0f} | {r['floor_ms']:.3f} |"
        for r in summary["top_ops"]
    ]
    return "\n".join(lines)


def _stats(event) -> dict:
    return {key: value for key, value in event.stats}


def _self_times(events: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """(op, start, duration) of one timeline -> (op, start, self time, end): an event that
    encloses others (a while or conditional thunk around its body's ops) keeps its own time.
    Only whole enclosure nests: consecutive GPU kernels can overlap by a timestamp's rounding
    (a kernel starting 0.1 us before the previous one ends), and must keep their times."""
    events = sorted(events, key=lambda e: (e[1], -e[2]))
    own = [d for _, _, d in events]
    stack: list[int] = []  # indices of the events enclosing the current one
    for i, (_, start, duration) in enumerate(events):
        while stack and start + duration > events[stack[-1]][1] + events[stack[-1]][2]:
            stack.pop()
        if stack:
            own[stack[-1]] -= duration
        stack.append(i)
    return [
        (name, start, max(t, 0.0), start + duration)
        for (name, start, duration), t in zip(events, own, strict=True)
    ]


def _events(profile, module: str) -> tuple[list[tuple[str, float, float, float]], float, str]:
    """(hlo_op, start_ns, self time in ns, end_ns) of every event of `module` on the device
    planes (a GPU's streams) or else on the host plane (XLA:CPU); the device time that no HLO
    op claims (copies, graph launches); the plane kind ("device" or "host")."""
    planes = list(profile.planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    hosts = [p for p in planes if p.name == "/host:CPU"]
    for kind, chosen in (("device", devices), ("host", hosts)):
        events, unclaimed = [], 0.0
        for plane in chosen:
            for line in plane.lines:
                if kind == "device" and not line.name.startswith("Stream"):
                    continue  # derived lines ("XLA Ops", ...) would count kernels twice
                timeline = []
                for e in line.events:
                    stats = _stats(e)
                    if str(stats.get("hlo_module", "")).endswith(module) and "hlo_op" in stats:
                        timeline.append((str(stats["hlo_op"]), e.start_ns, e.duration_ns))
                    elif kind == "device" and "hlo_op" not in stats:
                        unclaimed += e.duration_ns
                events += _self_times(timeline)
        if events:
            return events, unclaimed, kind
    raise ValueError(f"the trace holds no XLA op of a module ending in {module!r}")


def _traced_steps(profile, name: str) -> int:
    """How many StepTraceAnnotation events called `name` the host planes hold."""
    return sum(
        1
        for plane in profile.planes
        if plane.name.startswith("/host:")
        for line in plane.lines
        for e in line.events
        if e.name == name and "step_num" in _stats(e)
    )


def summarise(
    xplane: str,
    hlo: str,
    *,
    steps: int | None = None,
    module: str = "train_step",
    categories: Iterable[Category] = CATEGORIES,
    top: int = 20,
) -> dict:
    """The op time of `module` in the trace `xplane`, per step, ranked and by category.

    steps: how many runs of the program the trace holds (default: its `train` step
    annotations). Shares are of the summed op time; `span_ms_per_step` is first op start to
    last op end over the steps, so span minus op time is idle (or, on CPU, overlapped) time.
    """
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(xplane)
    events, unclaimed, plane = _events(profile, module)
    steps = steps or _traced_steps(profile, STEP_ANNOTATION)
    if not steps:
        raise ValueError(f"no '{STEP_ANNOTATION}' step annotations in {xplane}: pass steps")
    ops, categories = parse_hlo(hlo), tuple(categories)
    # a library call (cuBLAS, cuDNN) may launch several kernels per run: its bytes and FLOPs
    # count once per run of the program, not once per kernel
    runs = {op.name: times for op, times in kernels(hlo, ops) if op.opcode == "custom-call"}
    seconds, calls = collections.Counter(), collections.Counter()
    for name, _, duration, _ in events:
        seconds[name] += duration * 1e-9 / steps
        calls[name] += 1 / steps
    total = sum(seconds.values())
    span = (max(e[3] for e in events) - min(e[1] for e in events)) * 1e-9 / steps
    by_category, rows = collections.defaultdict(lambda: [0.0, 0.0, 0.0]), []
    for name, s in seconds.most_common():
        op = ops.get(name) or Op(name, "?", "?", "", "", "", "")
        category = next(label for label, test in categories if test(op))
        times = runs.get(name, calls[name])  # per step
        moved, flops = op.bytes * times, op.flops * times
        for i, value in enumerate((s, moved, flops)):
            by_category[category][i] += value
        rows.append(
            {
                "op": name,
                "kind": op.kind,
                "category": category,
                "shape": op.shape,
                "source": op.source,
                "op_name": op.op_name.removeprefix(f"jit({module})/"),
                "ms_per_step": 1e3 * s,
                "share": s / total,
                "kernels_per_step": calls[name],
                **_rates(s, moved, flops),
            }
        )
    categories_out = [
        {"category": c, "ms_per_step": 1e3 * s, "share": s / total, **_rates(s, moved, flops)}
        for c, (s, moved, flops) in sorted(by_category.items(), key=lambda kv: -kv[1][0])
    ]
    return {
        "trace": xplane,
        "plane": plane,
        "steps": steps,
        "op_ms_per_step": 1e3 * total,
        "span_ms_per_step": 1e3 * span,
        "unclaimed_device_ms_per_step": 1e3 * unclaimed * 1e-9 / steps,
        "ops_not_in_hlo": sum(1 for name in seconds if name not in ops),
        "categories": categories_out,
        "top_ops": rows[:top],
    }


def _rates(seconds: float, moved: float, flops: float) -> dict:
    """GB/s of the bytes at the ops' boundaries and GFLOP/s of their matmuls, over `seconds`."""
    return {
        "gb_per_s": moved / seconds / 1e9 if seconds else None,
        "gflop_per_s": flops / seconds / 1e9 if seconds and flops else None,
    }


def format_summary(summary: dict) -> str:
    """Markdown: a header line, the category table and the top-ops table."""
    lines = [
        f"{summary['steps']} steps on the {summary['plane']} plane of {summary['trace']}: "
        f"{summary['op_ms_per_step']:.2f} ms/step summed over ops, "
        f"{summary['span_ms_per_step']:.2f} ms/step from first op to last",
    ]
    if summary["unclaimed_device_ms_per_step"]:
        lines.append(
            f"device time that no HLO op claims: "
            f"{summary['unclaimed_device_ms_per_step']:.2f} ms/step"
        )
    lines += [
        "",
        "| category | ms/step | share of op time | GB/s | GFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['category']} | {r['ms_per_step']:.2f} | {100 * r['share']:.1f}% | "
        f"{_fmt(r['gb_per_s'])} | {_fmt(r['gflop_per_s'])} |"
        for r in summary["categories"]
    ]
    lines += [
        "",
        "| op | kind | shape | source (innermost) | jax op | kernels/step | ms/step | share | "
        "GB/s | GFLOP/s |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['op']} | {r['kind']} | {r['shape']} | {r['source']} | {r['op_name'][-48:]} | "
        f"{r['kernels_per_step']:g} | {r['ms_per_step']:.2f} | {100 * r['share']:.1f}% | "
        f"{_fmt(r['gb_per_s'])} | {_fmt(r['gflop_per_s'])} |"
        for r in summary["top_ops"]
    ]
    return "\n".join(lines)


def _fmt(rate: float | None) -> str:
    return "" if rate is None else f"{rate:,.0f}"


def newest_trace(path: str) -> str:
    """path itself if it is an .xplane.pb, else the newest .xplane.pb under it."""
    if path.endswith(".xplane.pb"):
        return path
    found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {path} (train.profile_steps writes one)")
    return max(found, key=os.path.getmtime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="an .xplane.pb, or a folder holding one (the newest)")
    parser.add_argument("--hlo", help=f"optimized HLO text (default: {HLO_FILE} beside it)")
    parser.add_argument("--steps", type=int, help="runs traced (default: step annotations)")
    parser.add_argument("--module", default="train_step", help="jitted function's name")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    xplane = newest_trace(args.trace)
    hlo_path = args.hlo or os.path.join(os.path.dirname(xplane), HLO_FILE)
    if not os.path.exists(hlo_path):
        raise FileNotFoundError(f"{hlo_path} not found: pass --hlo (compiled.as_text())")
    with open(hlo_path) as f:
        summary = summarise(xplane, f.read(), steps=args.steps, module=args.module, top=args.top)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
