"""One recorded pass of a run's model on one text: the reference engine's forward and its hand-derived
backward (note 000 LLM §3) on the run's own weights, every intermediate kept (qkv.explain.tap).

    explanation = trace(run, "To be, or not to be", target=" that")
    explanation.arrays["0.attn.weights"]   # A of layer 0, (H, T, S), float64
    explanation.meta                       # tokens, the explained position and target, the model, the loss

The loss is the cross-entropy of ONE target token at one position (note 003's next-token prediction):
  decoder          the text's tokens; the target follows the last one (default: the model's top token)
  encoder (MLM)    the text's tokens; the position is the first mask token (else the last token)
  encoder-decoder  the text is the source; the decoder reads the start token and predicts the target
Only the first token of --target is the target; the page says how many the target text had.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from qkv import ref
from qkv.formats.params import to_numpy
from qkv.data.tokenizer import MASK
from qkv.errors import QkvError
from qkv.explain.tap import Recorder
from qkv.ref.block import RESIDUALS, tapped
from qkv.ref.functional import (ACTIVATIONS, cross_entropy_backward, cross_entropy_forward, scope,
                                soft_cap_backward)
from qkv.ref.model import bigram_rows, make_context
from qkv.ref.norms import NORMS
from qkv.ref.positional import POSITIONALS

VOCAB_SHOWN = 200  # the page names the top tokens (every strategy keeps a prefix of the logits' order)
MAX_TOKENS = 64  # tokens explained; a longer text is cut (the page says so)
SOFTMAX_KERNELS = {"sdpa": "naive", "flash": "naive"}  # the same function, with A formed explicitly


@dataclass
class Explanation:
    meta: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float64 values, batch axis dropped


def explained_config(cfg):
    """The model config the reference engine runs: no dropout (inference), A formed explicitly."""
    if cfg.attention == "linear":
        raise QkvError("qkv explain shows softmax attention A = softmax(QK^T / sqrt(d_k)); model.attention=linear "
                       "forms no A (its kernel is a feature-map product, note 000 §15.3)")
    if cfg.arch == "encoder" and cfg.head == "none":
        raise QkvError("qkv explain needs an output to explain: this encoder has no head (model.head=none)")
    return replace(cfg, dropout=0.0, attention=SOFTMAX_KERNELS.get(cfg.attention, cfg.attention))


def token_texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(i)]) for i in ids]


def encode(run, text: str) -> tuple[list[int], bool]:
    """The text's ids (at most MAX_TOKENS, and no more than the model has positions for) and whether it was cut."""
    if run.tokenizer is None:
        raise QkvError(f"{run.path}: has no tokenizer.json; qkv explain needs one to read the text")
    if not text:
        raise QkvError("--text is empty")
    ids = run.tokenizer.bos_ids + run.tokenizer.encode(text)  # (<bos> first where the model's file asks)
    if not ids:
        raise QkvError("--text has no tokens")
    limit = min(MAX_TOKENS, run.config.model.max_seq_len)  # the model's positions end there
    return ids[:limit], len(ids) > limit


def target_id(run, target: str | None, labels=()) -> tuple[int | None, int]:
    """(id, how many tokens the target text had); None: the model's top token."""
    if target is None:
        return None, 0
    if labels:  # a classifier: the target is a class name or index
        if target in labels:
            return list(labels).index(target), 1
        raise QkvError(f"--target {target!r}: not one of the classifier's labels {list(labels)}")
    ids = run.tokenizer.encode(target)
    if not ids:
        raise QkvError("--target has no tokens")
    return ids[0], len(ids)


def inputs_for(run, cfg, ids: list[int]) -> tuple[tuple, dict]:
    """The family's inputs and where the loss is read."""
    x = np.array([ids])
    if cfg.arch == "encoder-decoder":
        start = run.tokenizer.eos_id  # qkv's seq2seq objective: [BOS] + target, BOS = EOS (qkv.generate)
        return (x, np.array([[start]])), {"position": 0, "source_ids": ids, "ids": [start]}
    position = len(ids) - 1
    if cfg.arch == "encoder":
        mask = _mask_id(run.tokenizer)
        position = ids.index(mask) if mask in ids else position
    return (x,), {"position": position, "ids": ids}


def _mask_id(tokenizer) -> int | None:
    try:
        return tokenizer.special_id(MASK)
    except QkvError:
        return None


def trace(run, text: str, target: str | None = None) -> Explanation:
    cfg = explained_config(run.config.model)
    ids, cut = encode(run, text)
    inputs, where = inputs_for(run, cfg, ids)
    params = to_numpy(run.model)
    recorder = Recorder()
    with tapped(recorder):
        logits, cache = ref.forward(params, cfg, *inputs)
        classifier = cfg.arch == "encoder" and cfg.head == "classifier"
        row = logits[0] if classifier else logits[0, where["position"]]  # (V,) or (C,)
        wanted, target_tokens = target_id(run, target, cfg.labels if classifier else ())
        wanted = int(np.argmax(row)) if wanted is None else wanted
        if not 0 <= wanted < row.shape[-1]:
            raise QkvError(f"--target: id {wanted} is outside the model's {row.shape[-1]} outputs")
        targets = np.full(logits.shape[:-1], -100)
        targets[(0,) if classifier else (0, where["position"])] = wanted
        loss, cce = cross_entropy_forward(logits, targets, ignore_index=-100)  # -log p(target)
        dlogits = cross_entropy_backward(1.0, cce)  # (P - onehot) at the position, 0 elsewhere
        grads = ref.backward(dlogits, cache, cfg)
    explanation = Explanation(meta={})
    _collect(explanation, recorder, cfg, params, grads, logits, dlogits, where, inputs, cache)
    meta = explanation.meta
    top = np.argsort(-row, kind="stable")[:VOCAB_SHOWN]
    meta.update(vocab={int(i): _label(run, cfg, int(i), classifier) for i in top}, model=_describe(run.config.model),
                name=run.path.name, summary=_summary(run.config.model))
    meta.update(text=text, cut=cut, loss=float(loss), family=cfg.arch, head=cfg.head, classifier=classifier,
                target={"id": wanted, "text": _label(run, cfg, wanted, classifier), "given": target,
                        "tokens": target_tokens, "chosen": target is None},
                tokens=token_texts(run.tokenizer, where["ids"]), ids=[int(i) for i in where["ids"]],
                position=where["position"])
    if "source_ids" in where:
        meta.update(source=token_texts(run.tokenizer, where["source_ids"]),
                    source_ids=[int(i) for i in where["source_ids"]])
    return explanation


def _label(run, cfg, wanted: int, classifier: bool) -> str:
    if classifier:
        return cfg.labels[wanted] if cfg.labels else str(wanted)
    return run.tokenizer.decode([wanted])


def layer_labels(cfg) -> list[dict]:
    """Each block call in forward order: its stack, its index there and its parameters' prefix."""
    if cfg.arch == "encoder-decoder":
        return ([{"stack": "encoder", "index": i, "prefix": f"encoder.blocks.{i}."} for i in range(cfg.encoder_layers)]
                + [{"stack": "decoder", "index": i, "prefix": f"blocks.{i}."} for i in range(cfg.decoder_layers)])
    if cfg.arch == "encoder":
        prefix = "" if cfg.head == "none" else "encoder."
        return [{"stack": "encoder", "index": i, "prefix": f"{prefix}blocks.{i}."} for i in range(cfg.encoder_layers)]
    return [{"stack": "decoder", "index": i, "prefix": f"blocks.{i}."} for i in range(cfg.decoder_layers)]


def _collect(explanation: Explanation, recorder: Recorder, cfg, params, grads, logits, dlogits, where, inputs,
             cache):
    arrays, meta = explanation.arrays, explanation.meta
    layers = layer_labels(cfg)
    for n, (layer, block) in enumerate(zip(layers, recorder.blocks)):
        layer["parts"] = [part["name"] for part in block["parts"]]
        for part in block["parts"]:
            for key, value in _flatten(part):
                arrays[f"{n}.{part['name']}.{key}"] = value
        names = [name for name in grads if name.startswith(layer["prefix"])]
        layer["grad_norm"] = float(np.sqrt(sum((grads[name] ** 2).sum() for name in names)))
        layer["stream_grad_norm"] = float(np.linalg.norm(block["parts"][-1]["d_stream_out"]))
    _embedding(arrays, meta, cfg, params, grads, layers, recorder, where, inputs)
    _output(arrays, meta, cfg, params, recorder, logits, dlogits, where)
    if cfg.arch == "encoder" and cfg.head == "mlm":  # BERT's head: LN(act(H W_t + b_t)), then W_V
        head = cache["tape"][3]
        arrays["output.mlm_transform"] = ACTIVATIONS.get(head.activation[1])[0](head.activation[0])[0]
        arrays["output.mlm_norm"] = head.decoder[0][0]
    for layer in layers:
        layer["label"] = f"{layer['stack']} {layer['index']}" if cfg.arch == "encoder-decoder" else f"layer {layer['index']}"
    meta.update(layers=layers, heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads, d_model=cfg.d_model)


def _flatten(record: dict, prefix: str = ""):
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, np.ndarray) and value.dtype != object and value.ndim:
            yield f"{prefix}{key}", np.asarray(value[0], dtype=np.float64)  # batch of one


def _embedding(arrays, meta, cfg, params, grads, layers, recorder, where, inputs):
    """Per stack: the rows of W_E looked up, the positional rows added (tables), H0 and its gradient,
    and dW_E's rows for the ids (the scatter-add, note 000 LLM §3.5)."""
    stacks = {}
    for n, layer in enumerate(layers):
        stacks.setdefault(layer["stack"], n)
    for stack, first in stacks.items():
        prefix = layers[first]["prefix"].rpartition("blocks.")[0]
        ids = inputs[0] if stack == "encoder" else inputs[-1]
        stack_params = scope(params, prefix.rstrip(".")) if prefix else params
        table = stack_params["tok_emb.weight"] if "tok_emb.weight" in stack_params else params["tok_emb.weight"]
        arrays[f"{stack}.embed.rows"] = table[ids[0]]  # E = onehot(X) W_E   (T, D)
        if "bigram_emb.weight" in stack_params:  # E_2[h(x_{t-1}, x_t)], the rows the bigram table adds
            bigrams = stack_params["bigram_emb.weight"]
            arrays[f"{stack}.embed.bigrams"] = bigrams[bigram_rows(ids, None, bigrams.shape[0])[0]]
        positional = cfg.positional
        if cfg.arch == "encoder-decoder" and stack == "decoder":  # T5's causal twin, as the engine's decoder
            positional = POSITIONALS.get(cfg.positional).decoder_twin or cfg.positional
        ctx = make_context(cfg, ids, None, causal=stack == "decoder", params=stack_params, positional=positional)
        table_rows, _ = ctx.positional.embed_forward(ctx.params, np.zeros((1, ids.shape[1], cfg.d_model)),
                                                     ctx.positions)  # P, the rows H0 = E + P adds
        if np.any(table_rows):
            arrays[f"{stack}.embed.positions"] = table_rows[0]
        first_part = recorder.blocks[first]["parts"][0]
        arrays[f"{stack}.embed.h0"] = first_part["stream_in"][0]
        arrays[f"{stack}.embed.d_h0"] = first_part["d_stream_in"][0]
        name = f"{prefix}tok_emb.weight" if f"{prefix}tok_emb.weight" in grads else "tok_emb.weight"
        arrays[f"{stack}.embed.d_rows"] = grads[name][ids[0]]  # dW_E's rows for these ids (all its uses)
    meta["positional"] = cfg.positional


def _output(arrays, meta, cfg, params, recorder, logits, dlogits, where):
    last = recorder.blocks[-1]["parts"][-1]
    hidden = last["stream_out"]
    if RESIDUALS.get(cfg.norm_placement).final_norm:
        prefix = "encoder." if cfg.arch == "encoder" else ""
        hidden, _ = NORMS.get(cfg.norm).forward(scope(params, f"{prefix}final_norm"), hidden, cfg.norm_eps)
    arrays["output.hidden"] = hidden[0]  # H^L as the head reads it   (T, D)
    classifier = cfg.arch == "encoder" and cfg.head == "classifier"
    arrays["output.logits"] = logits[0] if classifier else logits[0, where["position"]]  # (V,)
    arrays["output.d_logits"] = dlogits[0] if classifier else dlogits[0, where["position"]]  # P - onehot
    arrays["output.d_stream"] = last["d_stream_out"][0]  # dL/dH^L at the last block's output
    if cfg.arch != "encoder":  # logits = H^L W_out: dH^L = dlogits W_out (000 LLM §3.2), through a soft cap's
        out = params["lm_head.weight"] if "lm_head.weight" in params else params["tok_emb.weight"]  # tanh = L / c
        squashed = logits / cfg.logit_softcap if cfg.logit_softcap else None
        arrays["output.d_hidden"] = soft_cap_backward(dlogits, squashed)[0] @ out


def _summary(cfg) -> str:
    layers = (f"{cfg.encoder_layers}+{cfg.decoder_layers}" if cfg.arch == "encoder-decoder" else
              cfg.encoder_layers if cfg.arch == "encoder" else cfg.decoder_layers)
    return (f"{cfg.arch}, {layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, {cfg.positional}, "
            f"{cfg.norm_placement}-{cfg.norm}, {cfg.ffn} {cfg.activation}" + (f", MoE {cfg.moe_experts}" if cfg.moe_experts else "")
            + f", attention {cfg.attention}")


def _describe(cfg) -> dict:
    return {key: getattr(cfg, key) for key in ("arch", "vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff",
                                               "positional", "norm", "norm_placement", "activation", "ffn",
                                               "moe_experts", "moe_top_k", "attention", "window", "head", "qk_norm",
                                               "tie_embeddings", "bias")} | {
        "layers": cfg.encoder_layers + cfg.decoder_layers if cfg.arch == "encoder-decoder" else cfg.decoder_layers
        if cfg.arch == "decoder" else cfg.encoder_layers}
