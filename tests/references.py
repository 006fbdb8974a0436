"""Independent numpy references (float64, pair by pair, no shift tricks) of the layers and of
both model families, written from the papers' formulas and read off the modules' parameters."""

import math

import numpy as np

from xformer.positional.alibi import alibi_slopes


def value(param) -> np.ndarray:
    return np.asarray(param[...], np.float64)


def numpy_rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate feature pair (p, p + D/2) of x [B, L, H, D] by an explicit 2x2 rotation."""
    out = x.astype(np.float64).copy()
    half = x.shape[-1] // 2
    for li, pos in enumerate(positions):
        for p in range(half):
            angle = pos * base ** (-2.0 * p / x.shape[-1])
            rotation = np.array(
                [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
            )
            pair = np.stack([x[:, li, :, p], x[:, li, :, p + half]], -1)  # [B, H, 2]
            out[:, li, :, p], out[:, li, :, p + half] = np.moveaxis(pair @ rotation.T, -1, 0)
    return out


def numpy_bucket(distance: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucketing written out for one distance (query position - key position)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if distance < 0:
            bucket = num_buckets
        distance = abs(distance)
    else:
        distance = max(distance, 0)
    exact = num_buckets // 2
    if distance < exact:
        return bucket + distance
    wide = exact + math.log(distance / exact) / math.log(max_distance / exact) * (
        num_buckets - exact
    )
    return bucket + min(int(wide), num_buckets - 1)


def numpy_sinusoid(distance: int, d: int) -> np.ndarray:
    i = np.arange(d // 2)
    angles = distance / 10000.0 ** (2 * i / d)
    return np.stack([np.sin(angles), np.cos(angles)], -1).reshape(d)


def numpy_bias(scheme, name, q, k, qi, kj, layout, h, layer):
    """The logit term a scheme adds for query position qi, key position kj (head h)."""
    distance = qi - kj
    if name == "t5_bias":
        bucket = numpy_bucket(distance, not layout.causal, scheme.num_buckets, scheme.max_distance)
        return float(value(scheme.table)[bucket, h])
    if name == "alibi":
        return -float(alibi_slopes(scheme.num_heads)[h]) * abs(distance)
    if name == "relative":
        u, v = (value(p)[layer] if scheme.untied else value(p) for p in (scheme.u, scheme.v))
        u, v = u[h], v[h]
        clamp = scheme.clamp_len or abs(distance)
        r = numpy_sinusoid(int(np.clip(distance, -clamp, clamp)), scheme.d_model)
        rk = (r @ value(scheme.r_proj[layer].kernel)).reshape(scheme.num_heads, -1)[h]
        return (u @ k + (q + v) @ rk) / math.sqrt(len(q))
    return 0.0


def linear(module, inputs: np.ndarray) -> np.ndarray:
    """A Linear, or Projections with its n outputs side by side: [..., in] -> [..., n * out]."""
    kernel = value(module.kernel)
    out = inputs @ kernel.reshape(kernel.shape[0], -1)
    return out if module.bias is None else out + value(module.bias).reshape(-1)


def numpy_attention(attn, scheme, name, x, memory, layout, mask, layer, context=None):
    """attn (a MultiHeadAttention) on x [B, Lq, d] over keys [memory ; x], or over `context`
    [B, Lk, d] (cross-attention); scheme/name: the positional scheme acting on the logits."""
    if context is None:
        context = x if memory is None else np.concatenate([memory, x], 1)
    b, lq, lk, h, dh = x.shape[0], x.shape[1], context.shape[1], attn.num_heads, attn.head_dim
    if attn.kind == "self":
        q, k, v = np.split(linear(attn.qkv_proj, x), 3, -1)
    else:
        q, (k, v) = linear(attn.q_proj, x), np.split(linear(attn.kv_proj, context), 2, -1)
    q, k, v = q.reshape(b, lq, h, dh), k.reshape(b, lk, h, dh), v.reshape(b, lk, h, dh)
    q_pos = np.asarray(layout.q_start + np.arange(lq))
    k_pos = np.asarray(layout.k_start + np.arange(lk))
    if name == "rope":
        q, k = numpy_rope(q, q_pos, scheme.base), numpy_rope(k, k_pos, scheme.base)
    out = np.zeros((b, lq, h, dh))
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                scores = np.full(lk, -np.inf)
                for j in range(lk):
                    if mask[min(bi, mask.shape[0] - 1), 0, i, j]:
                        scores[j] = q[bi, i, hi] @ k[bi, j, hi] / math.sqrt(dh) + numpy_bias(
                            scheme,
                            name,
                            q[bi, i, hi],
                            k[bi, j, hi],
                            q_pos[i],
                            k_pos[j],
                            layout,
                            hi,
                            layer,
                        )
                if not np.isfinite(scores).any():  # a padded query: compared as zeros
                    continue
                p = np.exp(scores - scores.max())
                out[bi, i, hi] = (p / p.sum()) @ v[bi, :, hi]
    return linear(attn.out_proj, out.reshape(b, lq, h * dh))


def numpy_layer_norm(norm, x: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.epsilon) * value(norm.scale) + value(norm.bias)


def numpy_residual(res, x: np.ndarray, sublayer) -> np.ndarray:
    """Pre-LN: x + f(LN(x)); post-LN: LN(x + f(x))."""
    if res.pre_norm:
        return x + sublayer(numpy_layer_norm(res.norm, x))
    return numpy_layer_norm(res.norm, x + sublayer(x))


def numpy_ffn(ffn, x: np.ndarray) -> np.ndarray:
    return linear(ffn.down, np.maximum(linear(ffn.up, x), 0.0))


def _embedding(table: np.ndarray, tokens: np.ndarray, d_model: int, name: str) -> np.ndarray:
    """Scaled token embeddings, plus the sinusoids of positions 0..L-1 for "sinusoidal"."""
    x = table[tokens] * math.sqrt(d_model)
    if name == "sinusoidal":
        x = x + np.stack([numpy_sinusoid(p, d_model) for p in range(tokens.shape[1])])
    return x


def _attend(attn, scheme, name, layout, mask, layer, memory=None, context=None):
    """numpy_attention as a function of the queries' states h (a residual's sublayer)."""
    return lambda h: numpy_attention(attn, scheme, name, h, memory, layout, mask, layer, context)


def _ffn(ffn):
    return lambda h: numpy_ffn(ffn, h)


def _causal(q_len: int, k_len: int) -> np.ndarray:
    """[Lq, Lk]: the queries are the last q_len of k_len positions."""
    return np.arange(k_len)[None, :] <= k_len - q_len + np.arange(q_len)[:, None]


NUMPY_SCHEMES = ("none", "sinusoidal", "relative", "rope", "t5_bias", "alibi")


def numpy_encoder_decoder(model, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
    """Teacher-forced logits [B, Lt, V] of an EncoderDecoder (eval mode, positional scheme in
    NUMPY_SCHEMES) for one example per row, padded with id 0 at the end of each row."""
    from xformer.layout import Layout

    cfg, name = model.cfg, model.cfg.positional
    assert name in NUMPY_SCHEMES, name
    (ls, lt), src_valid, tgt_valid = (src.shape[1], tgt_in.shape[1]), src > 0, tgt_in > 0
    enc_mask = (src_valid[:, None, :, None] & src_valid[:, None, None, :]).astype(bool)
    self_mask = tgt_valid[:, None, :, None] & tgt_valid[:, None, None, :] & _causal(lt, lt)
    cross_mask = tgt_valid[:, None, :, None] & src_valid[:, None, None, :]
    layout = Layout(ls, ls, causal=False)
    x = _embedding(value(model.src_embed.embedding), src, cfg.d_model, name)
    for i, layer in enumerate(model.encoder):
        attend = _attend(layer.attn, model.src_positional, name, layout, enc_mask, i)
        x = numpy_residual(layer.attn_res, x, attend)
        x = numpy_residual(layer.ffn_res, x, _ffn(layer.ffn))
    encoded = x if model.encoder_norm is None else numpy_layer_norm(model.encoder_norm, x)
    layout, cross_layout = Layout(lt, lt), Layout(lt, ls, causal=False)
    y = _embedding(value(model.tgt_embed.embedding), tgt_in, cfg.d_model, name)
    for i, layer in enumerate(model.decoder):
        attend = _attend(layer.self_attn, model.tgt_positional, name, layout, self_mask, i)
        y = numpy_residual(layer.self_res, y, attend)
        attend = _attend(
            layer.cross_attn, None, "none", cross_layout, cross_mask, i, context=encoded
        )
        y = numpy_residual(layer.cross_res, y, attend)
        y = numpy_residual(layer.ffn_res, y, _ffn(layer.ffn))
    if model.decoder_norm is not None:
        y = numpy_layer_norm(model.decoder_norm, y)
    if model.output is None:
        return y @ value(model.tgt_embed.embedding).T
    return linear(model.output, y)


def numpy_language_model(model, tokens: np.ndarray, targets: np.ndarray, memory=None):
    """NLL [B, L] of a decoder-only LM (eval mode, causal or prefix_lm mask, plain softmax: no
    adaptive cutoffs, d_embed = d_model) and its new memory [layers, B, M, d]; `memory` holds
    fully valid earlier states, or is None (no earlier segment)."""
    from xformer.layout import Layout

    cfg, name = model.cfg, model.cfg.positional
    assert name in NUMPY_SCHEMES and not cfg.adaptive_cutoffs, name
    q_len, mem_len = tokens.shape[1], 0 if memory is None else memory.shape[2]
    mask = _causal(q_len, mem_len + q_len)[None, None]
    prefix_lm = cfg.decoder_mask == "prefix_lm"  # (no memory) the prefix sees itself both ways
    if prefix_lm:
        in_prefix = np.arange(q_len) < cfg.prefix_length
        mask = mask | (in_prefix[:, None] & in_prefix[None, :])
    else:
        assert cfg.decoder_mask == "causal", cfg.decoder_mask
    # t5_bias buckets distances by sign where a query sees later keys; other schemes need no flag
    layout = Layout.with_memory(q_len, mem_len, causal=not prefix_lm)
    x = _embedding(value(model.embed.tables[0]), tokens, cfg.d_model, name)
    inputs = []
    for i, layer in enumerate(model.layers):
        inputs.append(x)
        mem = None if memory is None else memory[i]
        if mem is not None and layer.attn_res.pre_norm:
            mem = numpy_layer_norm(layer.attn_res.norm, mem)
        attend = _attend(layer.attn, model.positional, name, layout, mask, i, memory=mem)
        x = numpy_residual(layer.attn_res, x, attend)
        x = numpy_residual(layer.ffn_res, x, _ffn(layer.ffn))
    if model.final_norm is not None:
        x = numpy_layer_norm(model.final_norm, x)
    table = value(model.softmax.tables[0])[: cfg.vocab_size]  # rows past it: FSDP padding
    logits = x @ table.T + value(model.softmax.bias)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    states = np.stack(inputs) if memory is None else np.concatenate([memory, np.stack(inputs)], 2)
    return nll, states[:, :, -cfg.mem_len :] if cfg.mem_len else states
