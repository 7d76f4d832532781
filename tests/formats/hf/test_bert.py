"""qkv.formats.hf.bert: BertModel, BertForMaskedLM and BertForSequenceClassification in and out (Post-LN, token types,
the embedding LayerNorm, the MLM transform and pooler heads), outputs equal to transformers', and task
checkpoints' `bert.` prefix."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from tests.formats.hf import LENGTHS, TOL, V, check_export, max_diff, right_padded, save_hf  # noqa: E402


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32, **kw)


ENCODERS = {
    "BertModel": lambda: transformers.BertModel(bert_config()),
    "BertForMaskedLM": lambda: transformers.BertForMaskedLM(bert_config()),
    "BertForSequenceClassification": lambda: transformers.BertForSequenceClassification(bert_config(num_labels=3)),
}


@pytest.mark.parametrize("name", ENCODERS)
def test_outputs_match_transformers(name, tmp_path):
    """Bare encoder -> hidden states (B, T, D); MLM -> (B, T, V) logits; classifier -> (B, C) logits."""
    model = ENCODERS[name]()
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    ids, mask = right_padded(2, 24, LENGTHS)
    types = torch.randint(0, 2, ids.shape)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    with torch.no_grad():
        out = model(**inputs)
        expected = out.logits if hasattr(out, "logits") else out.last_hidden_state
        got = run.model(ids, attention_mask=mask, token_type_ids=types)
    per_token = mask if expected.dim() == 3 else None
    assert got.shape == expected.shape and expected.std() > 0.005
    assert max_diff(got, expected, per_token) <= TOL
    check_export(run, type(model), tmp_path, inputs, expected, per_token)


def test_bare_bert_reads_a_prefixed_checkpoint(tmp_path):
    """A BertModel config over a task checkpoint's `bert.`-prefixed tensors still loads."""
    from safetensors.torch import load_file, save_file

    model = transformers.BertModel(bert_config())
    path = save_hf(model, tmp_path / "hf")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({"bert." + k: v for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids, mask = right_padded(2, 24, LENGTHS)
    with torch.no_grad():
        assert max_diff(qkv.load(path).model(ids, attention_mask=mask),
                        model(input_ids=ids, attention_mask=mask).last_hidden_state, mask) <= TOL
