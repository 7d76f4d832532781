"""qkv.formats.hf.gpt2: GPT2LMHeadModel in and out (Conv1D's (in, out) layout, the fused c_attn split, tying, the
activation names), logits and greedy generation equal to transformers', and OpenAI's hub layout."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from tests.formats.hf import TOL, V, check_decoder, check_greedy, max_diff, save_hf  # noqa: E402


def gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=None, eos_token_id=None, **kw)


MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config()),
    "gpt2-untied-relu": lambda: transformers.GPT2LMHeadModel(gpt2_config(tie_word_embeddings=False,
                                                                         activation_function="relu")),
}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    check_decoder(MODELS[name](), tmp_path)


def test_greedy_generation_matches_transformers(tmp_path):
    check_greedy(MODELS["gpt2"](), tmp_path)


def test_checkpoint_without_prefix_and_with_mask_buffers_loads(tmp_path):
    """OpenAI's GPT-2 checkpoints on the hub: no `transformer.` prefix, `attn.bias` causal-mask buffers."""
    from safetensors.torch import load_file, save_file

    model = MODELS["gpt2"]()
    path = save_hf(model, tmp_path / "hf")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        assert max_diff(qkv.load(path).model(ids), model(input_ids=ids).logits) <= TOL
