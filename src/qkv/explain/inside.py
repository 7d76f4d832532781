"""What a decoder does with its tensors, for the page's "inside" steps: qkv.interp's analyses (docs/interpretability.md)
on the run's torch model at the page's precision, the same text, the explained position and target.

    look_inside(run, explanation, corrupt="The capital of Italy is")

adds to the explanation (arrays named inside.*, batch axis dropped; meta entries for the tables):
    meta["lens"]                   the logit lens at the explained position: per layer (the embedding, each block's
                                   output) the top tokens and the target's rank and probability
    inside.heads.previous          (layers, heads) previous-token score on the text
    inside.heads.first             (layers, heads) first-token (sink) score on the text
    inside.heads.induction         (layers, heads) induction score on 25 random tokens repeated
    inside.dla.heads, .ffn         direct logit attribution of the target: each head's and each FFN's term (Pre-LN);
                                   meta["dla"]: the logit and the embedding's and constant terms
    inside.patching                (block inputs + the last output, tokens) with --corrupt: the share of the logit
    inside.patching.heads          difference given back by each vector / each head taken from the clean run;
                                   meta["patching"]: the two tokens, the two differences, the rows' names
"""
from __future__ import annotations

import numpy as np
import torch

from qkv.errors import QkvError
from qkv.interp import (direct_logit_attribution, head_patching_map, head_scores, induction_scores, logit_lens,
                        patching_map)


def look_inside(run, explanation, corrupt: str | None = None) -> None:
    meta, arrays = explanation.meta, explanation.arrays
    if meta["family"] != "decoder":
        if corrupt is not None:
            raise QkvError(f"--corrupt: activation patching reads a decoder's next-token logits; {run.path.name} is "
                           f"a {meta['family']} model")
        return
    model, position, target = run.model, meta["position"], meta["target"]["id"]
    ids = torch.tensor([meta["ids"]])
    decode = lambda i: run.tokenizer.decode([i])  # noqa: E731
    with torch.no_grad():
        rows = logit_lens(model, ids, position=position, target=target, top=5)
        meta["lens"] = [{"label": "embedding" if row["layer"] == 0 else f"layer {row['layer'] - 1}",
                         "top": [[decode(i), p] for i, p in row["top"]], "rank": row["target_rank"],
                         "prob": row["target_prob"]} for row in rows]
        scores = head_scores(model, ids)
        arrays["inside.heads.previous"] = np.array(scores["previous_token"])
        arrays["inside.heads.first"] = np.array(scores["first_token"])
        arrays["inside.heads.induction"] = np.array(induction_scores(model, run.config.model.vocab_size))
        try:
            found = direct_logit_attribution(model, ids[:, :position + 1], position=position, target=target)
        except QkvError:  # Post-LN: the stream is not a sum of the sublayers' outputs
            found = None
        if found is not None:
            terms = dict(found["components"])
            layers, heads = len(model.blocks), model.blocks[0].attn.n_heads
            arrays["inside.dla.heads"] = np.array([[terms[f"blocks.{i}.attn.head{h}"] for h in range(heads)]
                                                   for i in range(layers)])
            arrays["inside.dla.ffn"] = np.array([terms[f"blocks.{i}.ffn"] for i in range(layers)])
            biases = sum(value for name, value in terms.items() if name.endswith(".attn.bias"))
            meta["dla"] = {"logit": found["logit"], "embedding": terms["embed"], "constant": found["constant"] + biases}
        if corrupt is not None:
            _patching(run, explanation, ids[:, :position + 1], corrupt, target, decode)


def _patching(run, explanation, ids, corrupt: str, answer: int, decode) -> None:
    other = run.tokenizer.bos_ids + run.tokenizer.encode(corrupt)
    if len(other) != ids.shape[-1]:
        raise QkvError(f"--corrupt is {len(other)} tokens and the explained text {ids.shape[-1]}: patching needs "
                       "prompts of one length in tokens")
    other = torch.tensor([other])
    wrong = int(run.model(other)[0, -1].argmax())
    if wrong == answer:
        raise QkvError(f"--corrupt predicts the explained target too ({decode(answer)!r}): no logit difference to "
                       "give back; choose a text that changes the answer")
    found = patching_map(run.model, ids, other, answer=answer, wrong=wrong)
    explanation.arrays["inside.patching"] = np.array(found["recovered"])
    explanation.arrays["inside.patching.heads"] = np.array(head_patching_map(run.model, ids, other, answer=answer,
                                                                             wrong=wrong))
    layers = len(run.model.blocks)
    explanation.meta["patching"] = {
        "text": corrupt, "answer": decode(answer), "wrong": decode(wrong), "clean": found["clean"],
        "corrupted": found["corrupted"],
        "points": [f"layer {i} input" for i in range(layers)] + [f"layer {layers - 1} output"]}
