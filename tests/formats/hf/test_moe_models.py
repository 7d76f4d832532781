"""The mixture-of-experts families from Hugging Face dirs, each a tiny random model built with transformers' own
class: Mixtral (softmax over the top k; and with a sliding window), Qwen3-MoE (q/k norm, head_dim apart, narrower
experts, a dense layer listed in mlp_only_layers, gates renormalised or not), OLMoE (q/k normalised over all
heads, gates not renormalised). Logits within 1e-5 of transformers' in fp32 on right-padded rows, written back
and read by transformers again, greedy generation token for token. Routers are drawn with clear margins (std 1
rather than 0.02) so that a near-tie of two experts cannot flip a route between the engines."""
import json

import pytest
import torch
from safetensors.torch import save_file

import qkv

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_decoder, check_greedy, cli, perturbed, save_hf  # noqa: E402

SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             num_experts_per_tok=2, tie_word_embeddings=False)


def mixtral(window=None):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_hidden_layers=2, num_local_experts=4, sliding_window=window))


def qwen3_moe(norm_topk=True):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=3, num_experts=6, head_dim=12, moe_intermediate_size=20, mlp_only_layers=[1],
        norm_topk_prob=norm_topk))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**SMALL, num_hidden_layers=2, num_experts=4))


def gpt_oss(width: int = 24):
    """Sliding and global layers alternating (a window shorter than the rows), sinks, biases everywhere, YaRN with
    its ramp unrounded, GQA."""
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **{**SMALL, "intermediate_size": width}, num_hidden_layers=2, num_local_experts=4, head_dim=8, sliding_window=5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 16}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias", "proj.bias")):
                p.normal_(0.0, 0.5)  # (initialised to 0: drawn, so that reading them is tested)
            elif "experts" in name:
                p.normal_(0.0, 0.5)  # large enough that the SwiGLU's clamps bite
    return model


MODELS = {"mixtral": mixtral, "mixtral-sliding": lambda: mixtral(window=7), "qwen3_moe": qwen3_moe,
          "qwen3_moe-unnormalised": lambda: qwen3_moe(norm_topk=False), "olmoe": olmoe, "gpt_oss": gpt_oss}


def routed(model):
    """Norm gains perturbed (tests.formats.hf.perturbed) and routers with clear margins."""
    model = perturbed(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] < p.shape[1] // 2 + 8:
                p.normal_(0.0, 1.0)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    check_decoder(routed(MODELS[name]()), tmp_path)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
def test_greedy_generation_matches_transformers(name, tmp_path):
    torch.manual_seed(1)
    check_greedy(routed(MODELS[name]()), tmp_path)


def test_what_each_family_reads_as(tmp_path):
    torch.manual_seed(0)
    cfg = qkv.load(save_hf(routed(qwen3_moe(norm_topk=False)), tmp_path / "q")).config.model
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_d_ff, cfg.d_ff, cfg.moe_dense_layers, cfg.moe_norm_topk,
            cfg.head_dim, cfg.qk_norm, cfg.qk_norm_whole) == (6, 2, 20, 48, (1,), False, 12, True, False)
    cfg = qkv.load(save_hf(routed(olmoe()), tmp_path / "o")).config.model
    assert (cfg.qk_norm_whole, cfg.moe_norm_topk, cfg.moe_d_ff) == (True, False, 0)
    cfg = qkv.load(save_hf(routed(mixtral(window=7)), tmp_path / "m")).config.model
    assert (cfg.moe_norm_topk, cfg.layer_types, cfg.sliding_window) == (True, ("sliding",) * 2, 7)


def test_stacked_experts_of_transformers_modules_are_read(tmp_path):
    """transformers 5 holds each layer's experts in two stacked tensors (gate and up in one (E, 2F, D)); a
    checkpoint written from its state dict as it is reads with the same logits."""
    torch.manual_seed(2)
    model = routed(qwen3_moe())
    save_hf(model, tmp_path / "hf")
    stacked = {name: p.contiguous() for name, p in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    save_file(stacked, tmp_path / "hf" / "model.safetensors")
    run = qkv.load(tmp_path / "hf")
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(run.model(ids), model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in 1..4"),
    ({"num_experts": 0}, "no num_local_experts / num_experts"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
])
def test_bad_moe_configs_exit_2_with_one_line(tmp_path, change, message):
    torch.manual_seed(0)
    path = save_hf(olmoe(), tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    code, _, err = cli("generate", str(path), "--prompt", "a", "--max-new-tokens", "2")
    assert code == 2 and message in err and err.startswith("qkv: error:") and err.count("\n") == 1, err


def test_an_expert_tensor_missing_is_named(tmp_path):
    torch.manual_seed(0)
    model = routed(mixtral())
    path = save_hf(model, tmp_path / "hf")
    from safetensors.torch import load_file
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path / "model.safetensors")
    code, _, err = cli("generate", str(path), "--prompt", "a", "--max-new-tokens", "2")
    assert code == 2 and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in err and err.count("\n") == 1, err


def test_a_router_with_nan_is_refused_at_load(tmp_path):
    """A router whose weights hold a NaN routes every token to undefined experts: exit 2, one line naming it."""
    torch.manual_seed(0)
    path = save_hf(routed(mixtral()), tmp_path / "hf")
    from safetensors.torch import load_file
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.block_sparse_moe.gate.weight"][2, 5] = float("nan")
    save_file(tensors, path / "model.safetensors")
    code, _, err = cli("generate", str(path), "--prompt", "a", "--max-new-tokens", "2")
    assert code == 2 and "blocks.1.ffn.router.weight has NaN" in err and err.count("\n") == 1, err


def test_gpt_oss_mxfp4_experts_as_transformers_dequantizes_them(tmp_path):
    """A gpt-oss dir as the released ones are: experts in MXFP4 (random codes and scales). qkv's dequantization
    equals transformers' own (integrations.mxfp4.convert_moe_packed_tensors), and qkv's logits equal those of the
    transformers model holding those dequantized experts."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from qkv.formats.hf.gpt_oss import mxfp4

    torch.manual_seed(0)
    model = routed(gpt_oss(width=32))  # (MXFP4 groups of 32 inputs: the released model's 2,880 are 90 of them)
    path = save_hf(model, tmp_path / "hf")
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):
            blocks = torch.randint(0, 256, (4, rows, 1, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(120, 130, (4, rows, 1), generator=generator, dtype=torch.uint8)
            ours, theirs = mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
            with torch.no_grad():  # the reference model holds the dequantized experts
                getattr(model.model.layers[i].mlp.experts, name).copy_(theirs)
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(qkv.load(path).model(ids), model(ids).logits, rtol=0, atol=1e-4)


def test_gpt_oss_other_quantizations_are_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    path = save_hf(gpt_oss(), tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    code, _, err = cli("generate", str(path), "--prompt", "a", "--max-new-tokens", "2")
    assert code == 2 and "MXFP4" in err and err.count("\n") == 1, err
