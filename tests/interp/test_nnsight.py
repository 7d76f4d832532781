"""qkv.interp's analyses against the same analyses written with nnsight (a second, independent implementation of
the interventions) on the transformers model that holds the same weights: the logit lens, the residual-stream
patching map and the per-head patching map of an imported LLaMA (grouped-query attention) and a GPT-2.

With nnsight each intervention is written on the transformers modules themselves: a decoder layer's input is
its resid_pre, its output its resid_post, the input of the attention's output projection (o_proj, c_proj) the
heads' outputs z side by side; the lens applies transformers' own final norm and head."""
import pytest
import torch

from qkv.interp import head_patching_map, logit_lens, patching_map
from tests.interp.test_hooks import hf_pair

nnsight = pytest.importorskip("nnsight", reason="nnsight is a test dependency (pip install -e .[dev])")

LAYERS, HEADS, DH = 3, 4, 8


def parts(hf, family: str):
    """(the nnsight wrapper, its decoder layers, their attention output projections, final norm + head)."""
    wrapped = nnsight.NNsight(hf)
    if family == "llama":
        layers = wrapped.model.layers
        return wrapped, layers, [layer.self_attn.o_proj for layer in layers], lambda x: hf.lm_head(hf.model.norm(x))
    layers = wrapped.transformer.h
    return wrapped, layers, [layer.attn.c_proj for layer in layers], lambda x: hf.lm_head(hf.transformer.ln_f(x))


def stream(value):
    return value[0] if isinstance(value, tuple) else value


def prompts():
    clean = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 11) % 97
    corrupted[0, 5] = (clean[0, 5] + 29) % 97
    return clean, corrupted


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logit_lens_equals_nnsights(tmp_path, family):
    hf, model = hf_pair(tmp_path, family)
    ids, _ = prompts()
    wrapped, layers, _, read = parts(hf, family)
    saved = []
    with torch.no_grad():
        with wrapped.trace(ids):
            saved.append(layers[0].input.save())  # the embedding (GPT-2: + positions), entering block 0
            for layer in layers:
                saved.append(stream(layer.output).save())
        theirs = [read(h[0, -1]).softmax(-1) for h in saved]
    ours = logit_lens(model, ids, top=5)
    target = int(theirs[-1].argmax())  # the model's own top token, qkv's default target
    assert len(ours) == len(theirs) == LAYERS + 1
    for row, probs in zip(ours, theirs):
        top = torch.topk(probs, 5)
        assert [i for i, _ in row["top"]] == top.indices.tolist()
        assert [p for _, p in row["top"]] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert row["target_prob"] == pytest.approx(float(probs[target]), abs=1e-5)
        assert row["target_rank"] == int((probs > probs[target]).sum())


def difference(logits, answer, wrong):
    return float(logits[0, -1, answer] - logits[0, -1, wrong])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patching_maps_equal_nnsights(tmp_path, family):
    hf, model = hf_pair(tmp_path, family)
    clean, corrupted = prompts()
    wrapped, layers, projections, _ = parts(hf, family)
    with torch.no_grad():
        logits = hf(clean).logits
        answer, wrong = int(logits[0, -1].argmax()), int(logits[0, -1].argmin())
        inputs, heads = [], []
        with wrapped.trace(clean):
            for layer, projection in zip(layers, projections):
                inputs.append(layer.input.save())
                heads.append(projection.input.save())
            last = stream(layers[-1].output).save()
        high, low = difference(logits, answer, wrong), difference(hf(corrupted).logits, answer, wrong)

        def recovered(patch) -> float:
            with wrapped.trace(corrupted):
                patch()
                out = wrapped.lm_head.output.save()
            return (difference(out, answer, wrong) - low) / (high - low)

        def at_input(i, t):
            def patch():
                layers[i].input[:, t] = inputs[i][:, t]
            return patch

        def at_output(t):
            def patch():
                stream(layers[-1].output)[:, t] = last[:, t]
            return patch

        def head(i, h):
            def patch():
                projections[i].input[:, :, h * DH:(h + 1) * DH] = heads[i][:, :, h * DH:(h + 1) * DH]
            return patch

        theirs = [[recovered(at_input(i, t)) for t in range(7)] for i in range(LAYERS)]
        theirs.append([recovered(at_output(t)) for t in range(7)])
        their_heads = [[recovered(head(i, h)) for h in range(HEADS)] for i in range(LAYERS)]

    ours = patching_map(model, clean, corrupted, answer=answer, wrong=wrong)
    assert ours["clean"] == pytest.approx(high, abs=1e-4) and ours["corrupted"] == pytest.approx(low, abs=1e-4)
    for mine, want in zip(ours["recovered"], theirs):
        assert mine == pytest.approx(want, abs=1e-4)
    assert theirs[-1][-1] == pytest.approx(1.0, abs=1e-5)  # the last position's last stream: everything
    assert all(abs(theirs[0][t]) < 1e-6 for t in (0, 1, 3, 4, 6))  # block 0's input where the tokens agree
    for mine, want in zip(head_patching_map(model, clean, corrupted, answer=answer, wrong=wrong), their_heads):
        assert mine == pytest.approx(want, abs=1e-4)
    assert max(abs(v) for row in their_heads for v in row) > 0.05  # the heads matter here: a comparison of numbers


def test_qkv_imports_after_nnsight():
    """nnsight gives every object a `save` attribute; qkv's dataclasses must not take it for a field default."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import nnsight, qkv.formats, qkv.cli; "
                           "assert qkv.formats.FORMATS.get('hf').save is not None"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
