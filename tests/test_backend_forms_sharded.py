"""The other backends' program forms (the loss's online reduction, LayerNorm's statistics, the
FFN's output-masked ReLU, the XL position term's broadcast over the batch; see `use_form`) on a
data x tensor mesh of 4 simulated CPU devices, with the vocabulary, the FFN's hidden features,
the model features and the attention heads split over the tensor axis: values and gradients
equal the unsplit XLA:CPU form's in float64 (a bfloat16 LayerNorm, whose one-pass variance
differs from the two-pass form by design, equals its own unsplit run), and the loss's split
reduction gathers per-row partial statistics, never the logits."""

import json
import re
import sys
from pathlib import Path

import numpy as np
from simulated_devices import run_script


def test_other_backends_forms_split_over_a_mesh_equal_the_cpu_form(tmp_path):
    run_script(__file__, 4, str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["gaps"]) == {"loss", "ffn", "layer_norm", "xl_position"}
    for name, gap in report["gaps"].items():
        assert gap < 1e-12, (name, gap)
    assert report["bf16_layer_norm_gap"] < 2.0**-7  # bfloat16 outputs: within an ulp
    # [rows, tensor] partials only: 8 x 16 rows, 2 shards (the logits are [8, 16, 64])
    assert report["gathered"], "the split reduction should gather its partial statistics"
    assert max(report["gathered"]) <= 8 * 16 * 2, report["gathered"]


def _worker(workdir: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from xformer import activations, layer_norm, losses
    from xformer.blocks import FeedForward
    from xformer.layer_norm import LayerNorm
    from xformer.positional import xl_relative

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "tensor"))
    modules = (activations, layer_norm, losses, xl_relative)
    rng = np.random.default_rng()

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    def run(f, args, cpu_form: bool):
        """Leaves of f's value and gradients at args, in one form."""
        for module in modules:
            module.CPU_FORM_PLATFORMS = frozenset({"cpu"} if cpu_form else ())
        fn = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))
        return jax.tree.leaves(fn(*args)), fn

    def gap(f, args, split_args):
        """Largest gap, relative to the largest value, of the other form on split_args from
        the CPU form on args (one device's arrays)."""
        want, _ = run(f, args, cpu_form=True)
        got, fn = run(f, split_args, cpu_form=False)
        scale = max(float(np.abs(np.asarray(w)).max()) for w in want)
        return max(
            float(np.abs(np.asarray(g) - np.asarray(w)).max()) / scale
            for g, w in zip(got, want, strict=True)
        ), fn

    report = {"gaps": {}}
    with jax.enable_x64(True):
        # the loss: logits [8, 16, 64] split over rows (data) and the vocabulary (tensor)
        logits = rng.normal(size=(8, 16, 64)) * 3.0
        targets = jnp.asarray(rng.integers(0, 64, (8, 16)))
        weights = jnp.asarray(rng.random((8, 16)))

        def loss(x):
            loss_sum, nll_sum = losses.cross_entropy(x, targets, weights, 0.1)
            return loss_sum + 0.5 * nll_sum

        args = (jnp.asarray(logits),)
        report["gaps"]["loss"], fn = gap(loss, args, (put(logits, "data", None, "tensor"),))
        hlo = fn.lower(put(logits, "data", None, "tensor")).compile().as_text()
        report["gathered"] = [
            int(np.prod([int(d) for d in m[1].split(",") if d]))
            for m in re.finditer(r"= f64\[([\d,]*)\][^=]*? all-gather\(", hlo)
        ]

        # the FFN (d_ff 32, a multiple of 8: the output-masked ReLU) with its hidden split
        ffn = FeedForward(8, 32, dropout=0.0, param_dtype=jnp.float64, rngs=nnx.Rngs(1))
        graphdef, params, rest = nnx.split(ffn, nnx.Param, ...)
        x = rng.normal(size=(8, 6, 8))
        cotangent = jnp.asarray(rng.normal(size=(8, 6, 8)))

        def ffn_loss(params, x):
            return (nnx.merge(graphdef, params, rest)(x) * cotangent).sum()

        hidden = {"up/kernel": (None, "tensor"), "up/bias": ("tensor",), "down/kernel": ("tensor",)}

        def split_hidden(path, p):
            name = "/".join(str(getattr(k, "key", k)) for k in path[:2])
            return put(p, *hidden.get(name, ()))

        split_params = jax.tree_util.tree_map_with_path(split_hidden, params)
        report["gaps"]["ffn"], _ = gap(
            ffn_loss, (params, jnp.asarray(x)), (split_params, put(x, "data", None, None))
        )

        # the XL position term: (q + v) [B, Lq, H, D] over the batch and the heads, R W_kR
        # [W, H, D] over the heads
        qv, rk = rng.normal(size=(8, 5, 4, 3)), rng.normal(size=(9, 4, 3))
        scores_g = jnp.asarray(rng.normal(size=(8, 4, 5, 9)))

        def position_loss(qv, rk):
            return (xl_relative.position_scores(qv, rk) * scores_g).sum()

        report["gaps"]["xl_position"], _ = gap(
            position_loss,
            (jnp.asarray(qv), jnp.asarray(rk)),
            (put(qv, "data", None, "tensor"), put(rk, None, "tensor")),
        )

        # LayerNorm (float64: the backward keeping x with its statistics) with the model
        # features split, and in bfloat16 (the one-pass variance) against its own unsplit run
        norm = LayerNorm(16, epsilon=1e-6, param_dtype=jnp.float64, rngs=nnx.Rngs(2))
        rows = rng.normal(2.0, 3.0, (8, 6, 16))
        g = jnp.asarray(rng.normal(size=(8, 6, 16)))

        def norm_loss(x):
            return (norm(x).astype(g.dtype) * g).sum()

        split_rows = put(rows, "data", None, "tensor")
        report["gaps"]["layer_norm"], _ = gap(norm_loss, (jnp.asarray(rows),), (split_rows,))
        norm.dtype = jnp.bfloat16
        rows16 = jnp.asarray(rows, jnp.bfloat16)
        want, _ = run(norm_loss, (rows16,), cpu_form=False)
        got, _ = run(norm_loss, (put(rows16, "data", None, "tensor"),), cpu_form=False)
        report["bf16_layer_norm_gap"] = max(
            float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
            / float(np.abs(np.asarray(b, np.float64)).max())
            for a, b in zip(got, want, strict=True)
        )
    (workdir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
