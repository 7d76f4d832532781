"""qkv.load of Hugging Face dirs gives transformers' outputs (fp32, within 1e-5), for each family, and
qkv.hf.save writes dirs that from_pretrained loads with the same outputs. The oracle is transformers
itself, with random weights from tiny configs (no download)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv import hf  # noqa: E402
from tests.hf import V, max_diff, right_padded, save_hf  # noqa: E402

TOL = 1e-5
LENGTHS = [24, 17]  # right padding in row 1; long enough to reach T5's log-spaced buckets (distance >= 8)


def logits_both(model, run, ids, mask, **extra):
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, **extra).logits
        got = run.model(ids, attention_mask=mask, **extra)
    return expected, got


def check_export(run, cls, tmp_path, inputs: dict, expected: torch.Tensor, mask) -> None:
    """qkv -> HF dir -> transformers gives the same outputs again."""
    back = cls.from_pretrained(hf.save(run, tmp_path / "export")).eval()
    with torch.no_grad():
        out = back(**inputs)
    out = out.logits if hasattr(out, "logits") else out.last_hidden_state
    assert max_diff(out, expected, mask) <= TOL


def gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=None, eos_token_id=None, **kw)


def llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=32, bos_token_id=None,
                                    eos_token_id=None, **kw)


DECODERS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config()),
    "gpt2-untied-relu": lambda: transformers.GPT2LMHeadModel(gpt2_config(tie_word_embeddings=False,
                                                                         activation_function="relu")),
    "llama-gqa-untied": lambda: transformers.LlamaForCausalLM(llama_config(
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "llama-mha-tied-bias": lambda: transformers.LlamaForCausalLM(llama_config(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_match_transformers(name, tmp_path):
    model = DECODERS[name]()
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    ids, mask = right_padded(2, 24, LENGTHS)
    expected, got = logits_both(model, run, ids, mask)
    assert expected.std() > 0.01  # not a degenerate all-zero comparison
    assert max_diff(got, expected, mask) <= TOL
    check_export(run, type(model), tmp_path, {"input_ids": ids, "attention_mask": mask}, expected, mask)


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32, **kw)


ENCODERS = {
    "BertModel": lambda: transformers.BertModel(bert_config()),
    "BertForMaskedLM": lambda: transformers.BertForMaskedLM(bert_config()),
    "BertForSequenceClassification": lambda: transformers.BertForSequenceClassification(bert_config(num_labels=3)),
}


@pytest.mark.parametrize("name", ENCODERS)
def test_bert_outputs_match_transformers(name, tmp_path):
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


def t5_config(**kw):
    """Dh = 16, D = 64: T5's folded constants sqrt(Dh) and D^-1/2 (qkv.hf.t5) are exact in fp32. The init
    scale 0.2 keeps logits O(1) (T5's default gives |logits| ~ 20 here, where fp32 rounding alone is ~1e-5)."""
    return transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0, initializer_factor=0.2, **kw)


SEQ2SEQ = {
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)),
    "bart-scaled": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        scale_embedding=True, activation_function="relu")),
    "t5-relu-tied": lambda: transformers.T5ForConditionalGeneration(t5_config()),
    "t5-gated-gelu-untied": lambda: transformers.T5ForConditionalGeneration(t5_config(
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3,
        relative_attention_max_distance=20)),
    "t5-16-buckets": lambda: transformers.T5ForConditionalGeneration(t5_config(
        relative_attention_num_buckets=16, relative_attention_max_distance=40)),
}


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_logits_match_transformers(name, tmp_path):
    model = SEQ2SEQ[name]()
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    src, src_mask = right_padded(2, 26, [26, 19])
    tgt, tgt_mask = right_padded(2, 24, LENGTHS)
    inputs = {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
              "decoder_attention_mask": tgt_mask}
    with torch.no_grad():
        expected = model(**inputs).logits
        got = run.model(src, tgt, src_mask, tgt_mask)
    assert expected.std() > 0.01
    assert max_diff(got, expected, tgt_mask) <= TOL
    check_export(run, type(model), tmp_path, inputs, expected, tgt_mask)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_greedy_generation_matches_transformers(name, tmp_path):
    """Token for token, a batch of two left-padded prompts (positions count real tokens in both)."""
    model = DECODERS[name]()
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    prompt = torch.randint(1, V, (2, 6))
    mask = torch.ones_like(prompt)
    prompt[1, :2], mask[1, :2] = 0, 0  # left padding
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = qkv.generate(run.model, prompt, max_new_tokens=20, strategy="greedy", attention_mask=mask)
    assert got.tolist() == expected.tolist()


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers_loads(tmp_path):
    """OpenAI's GPT-2 checkpoints on the hub: no `transformer.` prefix, `attn.bias` causal-mask buffers."""
    from safetensors.torch import load_file, save_file

    model = DECODERS["gpt2"]()
    path = save_hf(model, tmp_path / "hf")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        assert max_diff(qkv.load(path).model(ids), model(input_ids=ids).logits) <= TOL
