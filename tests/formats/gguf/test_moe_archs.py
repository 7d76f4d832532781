"""The mixture-of-experts architectures in GGUF: Mixtral (llama with llama.expert_count), qwen3moe and olmoe, each a
tiny random transformers model read from its HF dir and written by qkv with its experts stacked as llama.cpp keeps
them (ffn_gate_exps / ffn_up_exps (E, F, D), ffn_down_exps (E, D, F), the router ffn_gate_inp). The oracles: the
HF model's own logits (qkv reading its file back), and llama.cpp reading qkv's file: logits within 1e-4 of the
largest (F32) and the same greedy tokens. Routers are drawn with clear margins (std 1) so that no near-tie of two
experts decides a route."""
import dataclasses

import numpy as np
import pytest
import torch

import qkv
from qkv.data.tokenizer import Tokenizer
from qkv.formats.gguf import save
from qkv.formats.gguf.reader import GgufFile
from tests.formats.gguf import llama_cpp, transformers
from tests.formats.hf import cli, perturbed

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, num_experts_per_tok=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4))


def qwen3moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, num_experts=6, head_dim=12, moe_intermediate_size=20, norm_topk_prob=True))


def olmoe():  # (llama.cpp's olmoe has no grouped K/V heads)
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{**SMALL, "num_key_value_heads": 4},
                                                                  num_hidden_layers=2, num_experts=4))


MODELS = {"llama": mixtral, "qwen3moe": qwen3moe, "olmoe": olmoe}


def routed(model):
    model = perturbed(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 1.0)
    return model


def written(tmp_path, arch: str):
    torch.manual_seed(0)
    model = routed(MODELS[arch]())
    model.save_pretrained(tmp_path / "hf")
    run = dataclasses.replace(qkv.load(tmp_path / "hf"), tokenizer=Tokenizer.train(["To be, or not to be"] * 5, 300))
    return model, save(run, tmp_path / f"{arch}.gguf")


@pytest.mark.parametrize("arch", MODELS)
def test_written_by_qkv_read_back_and_by_llama_cpp(arch, tmp_path):
    model, path = written(tmp_path, arch)
    file = GgufFile.open(path)
    assert file.get("general.architecture") == arch and file.get(f"{arch}.expert_count") in (4, 6)
    shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist())) for name, t in file.tensors.items()}
    experts, width = (6, 20) if arch == "qwen3moe" else (4, 48)
    assert shapes["blk.1.ffn_gate_exps.weight"] == (experts, width, 32)
    assert shapes["blk.1.ffn_down_exps.weight"] == (experts, 32, width)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (experts, 32)
    ids = torch.randint(3, 250, (1, 23))
    with torch.no_grad():
        expected = model(ids).logits
        ours = qkv.load(path).model(ids)
    assert (ours - expected).abs().max() < 1e-4 * expected.abs().max()
    theirs = llama_cpp.logits(path, ids[0].tolist())
    relative = float(np.abs(theirs - ours[0].double().numpy()).max() / ours.abs().max())
    assert relative < 1e-4, relative
    prompt = ids[0, :6].tolist()
    mine = qkv.generate(qkv.load(path).model, torch.tensor([prompt]), max_new_tokens=12, strategy="greedy")
    assert llama_cpp.greedy(path, prompt, 12) == mine[0, 6:].tolist()


def test_a_model_llama_cpp_would_route_otherwise_is_not_written(tmp_path):
    """llama.cpp's qwen3moe always renormalises the gates: a Qwen3-MoE without norm_topk_prob has no GGUF form."""
    torch.manual_seed(0)
    model = routed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, num_experts=6, head_dim=12, moe_intermediate_size=20, norm_topk_prob=False)))
    model.save_pretrained(tmp_path / "hf")
    code, _, err = cli("convert", str(tmp_path / "hf"), "--to-gguf", str(tmp_path / "out.gguf"))
    assert code == 2 and "norm_topk_prob=false" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.gguf").exists()


def test_expert_counts_that_disagree_exit_2(tmp_path):
    """A file whose expert_used_count exceeds its expert_count, or whose stacked experts are fewer than it says."""
    _, path = written(tmp_path, "llama")
    import gguf

    for key, value, message in (("llama.expert_used_count", 5, "num_experts_per_tok=5 must be in 1..4"),
                                ("llama.expert_count", 8, "stacks 4 experts where the config says 8")):
        reader = gguf.GGUFReader(str(path))
        bad = tmp_path / f"bad-{value}.gguf"
        writer = gguf.GGUFWriter(str(bad), "llama")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            contents = value if field.name == key else field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(field.name, contents)
            else:
                writer.add_key_value(field.name, contents, kind)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=None, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        code, _, err = cli("generate", str(bad), "--prompt", "To be", "--max-new-tokens", "2")
        assert code == 2 and message in err and err.count("\n") == 1, err
