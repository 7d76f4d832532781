"""The steps of `qkv explain`'s page, in the order of the notes: each with its formula, its citation, its
derivation page, and the recorded arrays it shows (names from qkv.explain.trace; `{L}` is the layer the
reader picks, `head` panels are sliced at the picked head).

A panel: (label, array, axes) with axes "rows x cols" named from: q (the layer's query tokens), k (its key
tokens: the source for cross-attention), tokens (the stack's tokens), d (feature index), f (FFN unit),
k (a top-k slot), v (vocabulary), layers, heads, points (the patched streams). Panels whose array a model
does not have are left out of its page.

The "inside" steps (a decoder's, qkv.explain.inside) come after the backward: what the model does with these
tensors, measured with the hook points on the torch model at the page's precision.
"""
from __future__ import annotations


def panel(label: str, array: str, axes: str, head: bool = False) -> dict:
    rows, _, cols = axes.partition(" x ")
    return {"label": label, "array": array, "rows": rows, "cols": cols or None, "head": head}


def step(id: str, phase: str, title: str, formula: str, cite: str, doc: str, text: str, panels=(),
         scope: str = "model", part: str | None = None, special: str | None = None) -> dict:
    return {"id": id, "phase": phase, "title": title, "formula": formula, "cite": cite, "doc": doc, "text": text,
            "panels": list(panels), "scope": scope, "part": part, "special": special}


def attention_steps(part: str, name: str) -> list[dict]:
    p = f"{{L}}.{part}"
    cross = part == "cross_attn"
    keys = "the encoder's output M (the memory)" if cross else "the same tokens"
    return [
        step(f"{part}.qkv", "forward", f"{name}: Q, K, V", "Q = H W_Q,  K = %s W_K,  V = %s W_V   (per head: "
             "d_k = D / h columns)" % (("M", "M") if cross else ("H", "H")),
             "note 000 §2.1.2, LLM §2.2.1 steps 1-2", "attention.md",
             f"Each token's normalised state is projected to a query; keys and values come from {keys}. The "
             "head picker selects one head's columns (after RoPE's rotation where the model uses it).",
             [panel("Q (queries x d_k)", f"{p}.q", "q x d", True), panel("K (keys x d_k)", f"{p}.k", "k x d", True),
              panel("V (keys x d_v)", f"{p}.v", "k x d", True)], scope="head", part=part),
        step(f"{part}.scores", "forward", f"{name}: scores S = QK^T / sqrt(d_k)",
             "S = Q K^T / sqrt(d_k)  (+ the score bias B of ALiBi / T5 / Shaw / Transformer-XL)",
             "note 000 §2.1.3, LLM §2.2.1 step 3", "attention.md",
             "Dot products of every query with every key, scaled so their variance stays near 1 as d_k grows "
             "(note 000 §2.1.3). Rows are queries, columns keys.",
             [panel("S (queries x keys)", f"{p}.scores", "q x k", True)]
             + ([] if cross else [panel("score bias B", f"{p}.bias", "q x k", True)]),  # cross-attention has none
             scope="head", part=part),
        step(f"{part}.softmax", "forward", f"{name}: mask and softmax", "A = softmax(S + M),  M_ij = 0 where "
             "allowed, -inf where masked (causal: j > i)", "note 000 §2.1.4, §8.2.1", "attention.md",
             "The mask removes the keys a query may not see (the future in a decoder, padding, a sparse "
             "pattern); each row of A is then a probability distribution over the keys.",
             [panel("M (1 = allowed)", f"{p}.allowed", "q x k"), panel("A = softmax(S + M)", f"{p}.weights",
                                                                       "q x k", True)],
             scope="head", part=part),
        step(f"{part}.values", "forward", f"{name}: A V, concatenation and W^O",
             "head_h = A_h V_h;  MultiHead = Concat(head_1..head_h) W_O", "note 000 §2.2.3, LLM §2.2.1 steps 3-4",
             "attention.md", "Each head's output is a weighted average of its values; the heads are concatenated "
             "side by side and mixed by W_O.",
             [panel("Concat(head_1..head_h) (the picked head is its columns h d_k .. (h+1) d_k)", f"{p}.merged",
                    "q x d"), panel("MultiHead(H) = Concat W_O", f"{p}.output", "q x d")], scope="layer", part=part),
        *norm_steps(part, name),
    ]


def norm_steps(part: str, name: str) -> list[dict]:
    p = f"{{L}}.{part}"
    return [step(f"{part}.residual", "forward", f"{name}: residual and norm",
                 "Pre-LN: H' = H + F(LN(H));  Post-LN: H' = LN(H + F(H));  LN(x) = gamma (x - mu) / "
                 "sqrt(sigma^2 + eps) + beta", "note 000 §5.1, §6.1; note 003 (Pre-LN, RMSNorm)",
                 "residual.md", "The norm removes each token's mean and variance (RMSNorm: only the root mean "
                 "square); the residual adds the sublayer's output to the stream it read.",
                 [panel("norm input", f"{p}.norm.input", "tokens x d"),
                  panel("mean mu (per token)", f"{p}.norm.mean", "tokens"),
                  panel("variance sigma^2 (per token)", f"{p}.norm.var", "tokens"),
                  panel("RMS (per token)", f"{p}.norm.rms", "tokens"),
                  panel("norm output", f"{p}.norm.output", "tokens x d"),
                  panel("inner norm output (sandwich)", f"{p}.norm_inner.output", "tokens x d"),
                  panel("stream before", f"{p}.stream_in", "tokens x d"),
                  panel("stream after", f"{p}.stream_out", "tokens x d")], scope="layer", part=part)]


def forward_steps(family: str) -> list[dict]:
    steps = [
        step("tokens", "forward", "Tokenization", "text -> tokens -> ids", "note 003 (tokenizer)", "embedding.md",
             "The tokenizer cuts the text into tokens; each has an id, a row of the embedding table.",
             special="tokens"),
        step("embedding", "forward", "Embedding lookup", "E = onehot(X) W_E  (one row of W_E per id)",
             "note 000 LLM §2.1", "embedding.md", "Each id selects one row of W_E.",
             [panel("W_E rows (encoder / source)", "encoder.embed.rows", "tokens x d"),
              panel("W_E rows", "decoder.embed.rows", "tokens x d"),
              panel("E_2 rows: the hashed bigram table, row h(x_{t-1}, x_t), added", "decoder.embed.bigrams",
                    "tokens x d")]),
        step("positions", "forward", "Positions", "sinusoidal / learned: H0 = E + P;  RoPE: q, k rotated by "
             "angle m theta_i;  ALiBi / T5 / Shaw / XL: a bias added to S", "note 000 §3.1, §11; note 002 (RoPE, "
             "relative positions)", "rope.md", "", [
                 panel("P, the table rows added (source)", "encoder.embed.positions", "tokens x d"),
                 panel("P, the table rows added", "decoder.embed.positions", "tokens x d"),
                 panel("H0 (source)", "encoder.embed.h0", "tokens x d"), panel("H0", "decoder.embed.h0", "tokens x d"),
                 panel("q before RoPE (layer {L})", "{L}.attn.q_raw", "q x d", True),
                 panel("q after RoPE", "{L}.attn.q", "q x d", True),
                 panel("score bias B (layer {L})", "{L}.attn.bias", "q x k", True)], special="positions"),
        *attention_steps("attn", "Self-attention"),
    ]
    if family == "encoder-decoder":
        steps += attention_steps("cross_attn", "Cross-attention")
    steps += [
        step("ffn", "forward", "Feed-forward network", "FFN(x) = act(x W_1 + b_1) W_2 + b_2;  GLU: (act(x W_g) * "
             "x W_u) W_d;  MoE: sum over the top-k experts g_e FFN_e(x) (+ the shared experts)", "note 000 §4, LLM §2.2.2; note 003 "
             "(SwiGLU, MoE)", "ffn.md", "Each token passes through the same two-layer network independently; "
             "the hidden units that fire (act > 0) are bright.",
             [panel("hidden act(.) (which units fire)", "{L}.ffn.hidden", "tokens x f"),
              panel("router scores s = softmax(x W_r) (sigmoid: DeepSeek-V3)", "{L}.ffn.router_probs", "tokens x e"),
              panel("chosen experts (their indices, one column per slot of the top-k)", "{L}.ffn.experts", "tokens x k"),
              panel("gates g (per slot)", "{L}.ffn.gates", "tokens x k"),
              panel("FFN output", "{L}.ffn.output", "tokens x d")], scope="layer", part="ffn"),
        *norm_steps("ffn", "FFN"),
        step("output", "forward", "Output: logits, softmax, next token", "logits = LN(H^L) W_out;  p = "
             "softmax(logits / T), then top-k / top-p truncation", "note 000 LLM §2.3; note 003 (decoding "
             "strategies)", "cross_entropy.md", "The last hidden state at the explained position is compared "
             "with every token's output row. Move the controls: the distribution is recomputed here as the "
             "sampling strategies of note 003 do.",
             [panel("H^L as the head reads it", "output.hidden", "tokens x d"),
              panel("MLM head: act(H^L W_t + b_t)", "output.mlm_transform", "tokens x d"),
              panel("MLM head: LN(act(H^L W_t + b_t)), which W_V (W_E when tied) reads", "output.mlm_norm", "tokens x d"),
              panel("logits (the explained position)", "output.logits", "v")], special="output"),
    ]
    return steps


def backward_steps(family: str) -> list[dict]:
    b = "{L}"
    steps = [
        step("b.loss", "backward", "Loss gradient", "L = -log p_y;  dL/dlogits = p - onehot(y)",
             "note 000 LLM §3.1", "cross_entropy.md", "The backward starts at the loss of the one target "
             "token: the gradient is the predicted distribution minus the one-hot target.",
             [panel("dL/dlogits = p - onehot(y)", "output.d_logits", "v")], special="loss"),
        step("b.head", "backward", "Through the output layer", "dH^L = dlogits W_out (W_out = W_E when tied);  "
             "dW_out = dlogits^T H^L", "note 000 LLM §3.2", "linear.md", "Only the explained position has "
             "a loss, so only its row is non-zero here; attention will spread it to earlier tokens.",
             [panel("dL/dH^L (after the head)", "output.d_hidden", "tokens x d"),
              panel("dL/d(last block output) (after the final norm)", "output.d_stream", "tokens x d")]),
        step("b.ffn", "backward", "FFN backward", "dA2 = dC W_2^T;  dA1 = dA2 * act'(A1) (ReLU: the mask "
             "I(A1 > 0));  dx = dA1 W_1^T", "note 000 LLM §3.3.2", "ffn.md",
             "The activation's derivative gates the gradient: units that did not fire pass nothing back (ReLU).",
             [panel("dL/dFFN output", f"{b}.ffn.d_output", "tokens x d"),
              panel("dL/dhidden (dA2)", f"{b}.ffn.d_hidden", "tokens x f"),
              panel("act'(A1) (the activation mask)", f"{b}.ffn.activation_grad", "tokens x f"),
              panel("dL/dFFN input", f"{b}.ffn.d_input", "tokens x d")], scope="layer", part="ffn"),
        *norm_backward("ffn", "FFN"),
    ]
    if family == "encoder-decoder":
        steps += [*attention_backward("cross_attn", "Cross-attention"), *norm_backward("cross_attn", "Cross-attention")]
    steps += [
        *attention_backward("attn", "Self-attention"), *norm_backward("attn", "Self-attention"),
        step("b.embedding", "backward", "Embedding: scatter-add", "dW_E[x_t] += dH0_t (each token's gradient "
             "added to its id's row; tied: plus the output layer's dlogits^T H^L)", "note 000 LLM §3.5",
             "embedding.md", "The embedding's gradient is a scatter-add: rows of ids that do not occur get "
             "nothing from the embedding (a tied W_E still gets the output layer's share).",
             [panel("dL/dH0 (source)", "encoder.embed.d_h0", "tokens x d"), panel("dL/dH0", "decoder.embed.d_h0",
                                                                               "tokens x d"),
              panel("dW_E rows of these ids (source)", "encoder.embed.d_rows", "tokens x d"),
              panel("dW_E rows of these ids", "decoder.embed.d_rows", "tokens x d")]),
        step("b.gradnorm", "backward", "Gradient norm per layer", "||dL/dH^l||  and  ||dL/dtheta_l||, l = 1..L",
             "note 000 §12 (gradient flow)", "residual.md", "The residual path carries the gradient to every "
             "layer (note 000 §12.1); Pre-LN and Post-LN differ in how it is scaled on the way (SPEC claim 31).",
             special="gradnorm"),
    ]
    return steps


def attention_backward(part: str, name: str) -> list[dict]:
    p = f"{{L}}.{part}"
    return [step(f"b.{part}", "backward", f"{name} backward: dV, dA, dS, dQ, dK",
                 "dV = A^T dO;  dA = dO V^T;  dS = A * (dA - rowsum(A * dA));  dQ = dS K / sqrt(d_k);  "
                 "dK = dS^T Q / sqrt(d_k)", "note 000 LLM §3.3.3 steps 1-4", "attention.md",
                 "The softmax's backward (dS) is the row-wise Jacobian A (dA - rowsum(A dA)); masked entries "
                 "have A = 0, so they get no gradient. dQ and dK are the kernel's shares: a content-dependent "
                 "score bias (Shaw's key term, Transformer-XL) adds its own before the projections.",
                 [panel("dO (this head's dL/dhead)", f"{p}.d_heads", "q x d", True),
                  panel("dV = A^T dO", f"{p}.d_v", "k x d", True), panel("dA = dO V^T", f"{p}.d_weights", "q x k", True),
                  panel("dS = A * (dA - rowsum(A * dA))", f"{p}.d_scores", "q x k", True),
                  panel("dQ = dS K / sqrt(d_k)", f"{p}.d_q", "q x d", True),
                  panel("dK = dS^T Q / sqrt(d_k)", f"{p}.d_k", "k x d", True),
                  panel(f"dL/d{name.lower()} input", f"{p}.d_input", "q x d")], scope="head", part=part)]


def norm_backward(part: str, name: str) -> list[dict]:
    p = f"{{L}}.{part}"
    return [step(f"b.{part}.residual", "backward", f"{name}: residual and norm backward",
                 "Pre-LN: dx = dy + LN'^T F'^T dy;  Post-LN: dz = LN'^T dy, dx = dz + F'^T dz;  LN: dx_i = "
                 "dxhat_i / sqrt(sigma^2 + eps) + dsigma^2 2 (x_i - mu) / d + dmu / d",
                 "note 000 §6.3, LLM §3.3.1", "layernorm.md", "The identity path of the residual passes the "
                 "gradient through unchanged; the norm's backward adds the sublayer's share.",
                 [panel("dL/dstream after", f"{p}.d_stream_out", "tokens x d"),
                  panel("dL/dnorm output", f"{p}.norm.d_output", "tokens x d"),
                  panel("dL/dnorm input", f"{p}.norm.d_input", "tokens x d"),
                  panel("dL/dstream before", f"{p}.d_stream_in", "tokens x d")], scope="layer", part=part)]


def inside_steps() -> list[dict]:
    return [
        step("inside.lens", "inside", "Logit lens: the answer layer by layer", "lens_l = softmax(LN_f(H^l) W_out)"
             " at the explained position, H^0 = the embedding, H^l = block l's output", "note 000 §6 (the residual "
             "stream); nostalgebraist 2020", "residual.md", "Each layer's residual stream read as if it were the "
             "last: through the final norm and the output layer. The rank of the target (0 = the top token) says "
             "in which layer the answer appears; the last row is the model's own output.", special="lens"),
        step("inside.heads", "inside", "What each head attends to", "previous-token: mean_t A[t, t-1];  first-token:"
             " mean_t A[t, 0];  induction: mean over the second copy of A[t, t - n + 1] on n random tokens repeated",
             "note 000 §2.1.3; Olsson et al. 2022; Xiao et al. 2023", "attention.md", "Scores from the attention "
             "weights A of every layer (rows) and head (columns): a previous-token head copies from the token just "
             "before, a first-token head parks its weight on position 0 (an attention sink), an induction head "
             "finds the token that followed the current one last time.",
             [panel("previous-token score (on the text)", "inside.heads.previous", "layers x heads"),
              panel("first-token (sink) score (on the text)", "inside.heads.first", "layers x heads"),
              panel("induction score (25 random tokens, repeated)", "inside.heads.induction", "layers x heads")]),
        step("inside.dla", "inside", "Direct logit attribution: who writes the target's logit",
             "logit_y = (e + sum_l sum_h z_h^l W_O,h^l + sum_l FFN_l) * s * g . W_out[y] + c   (s: the final "
             "norm's scale, frozen)", "note 000 §6 (Pre-LN), §2.1.4 (Concat W_O); Elhage et al. 2021",
             "residual.md", "A Pre-LN stream is a sum: the embedding, every head's output through its rows of W_O "
             "and every FFN's output. With the final norm's scale fixed at its value here the target's logit splits "
             "into their terms (red adds to it, blue takes away); they add up to the logit exactly.",
             [panel("each head's term (layers x heads)", "inside.dla.heads", "layers x heads"),
              panel("each FFN's term (per layer)", "inside.dla.ffn", "layers")], special="dla"),
        step("inside.patching", "inside", "Activation patching: where the answer is carried",
             "recovered = (diff(corrupted with one vector from the clean run) - diff(corrupted)) / (diff(clean) - "
             "diff(corrupted)),  diff = logit(answer) - logit(wrong) at the last position",
             "note 000 §6 (the residual stream); Meng et al. 2022; Wang et al. 2022", "residual.md", "The corrupted text runs with one vector of the "
             "residual stream (a layer's input at one position) or one head's output taken from the clean run; "
             "the share of the logit difference that comes back says where the information that separates the two "
             "answers travels. Needs qkv explain --corrupt TEXT (as many tokens as the text).",
             [panel("residual stream: layer inputs (and the last output) x positions", "inside.patching",
                    "points x tokens"),
              panel("each head's output (layers x heads)", "inside.patching.heads", "layers x heads")],
             special="patching"),
    ]


def steps_for(family: str) -> list[dict]:
    return forward_steps(family) + backward_steps(family) + (inside_steps() if family == "decoder" else [])
