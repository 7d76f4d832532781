"""An MoE's routing through its hook points (qkv.nn.moe: `router`, `gates`): qkv.interp.expert_routes against the
router logits transformers itself returns for the same Qwen3-MoE (output_router_logits), a rerouting hook against
the hand-computed expert, and `qkv probe --experts`."""
import json

import pytest
import torch

import qkv
from qkv.interp import expert_routes, run_with_hooks

transformers = pytest.importorskip("transformers")

from tests.formats.hf import cli, perturbed  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    torch.manual_seed(0)
    model = perturbed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, head_dim=12, moe_intermediate_size=20,
        mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # clear margins between experts
    path = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    model.save_pretrained(path)
    return model, qkv.load(path)


def test_routes_are_transformers_router_choices(qwen3_moe):
    model, run = qwen3_moe
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        theirs = model(ids, output_router_logits=True).router_logits  # the MoE layers' (T, E) logits
    routes = expert_routes(run.model, ids)
    assert [r["point"] for r in routes] == ["blocks.0.ffn.gates", "blocks.2.ffn.gates"]  # layer 1 is dense
    for route, logits in zip(routes, theirs):
        probs = logits.float().softmax(-1)
        top, experts = probs.topk(2, dim=-1)
        assert route["experts"] == experts.tolist()
        torch.testing.assert_close(torch.tensor(route["gates"]), top / top.sum(-1, keepdim=True), rtol=0, atol=1e-5)
        assert sum(route["load"]) == pytest.approx(1.0)


def test_a_gates_hook_reroutes_every_token(qwen3_moe):
    """Replacing the gates by 1 on expert 3 (and 0 elsewhere) makes layer 0's FFN expert 3's alone."""
    _, run = qwen3_moe
    ids = torch.randint(0, 100, (1, 7))
    layer = run.model.blocks[0].ffn

    def only_three(gates, name):
        forced = torch.zeros_like(gates)
        forced[..., 3] = 1.0
        return forced

    seen = {}
    run_with_hooks(run.model, ids, [("blocks.0.ffn.gates", only_three),
                                    ("blocks.0.resid_mid", lambda x, name: seen.setdefault("mid", x)),
                                    ("blocks.0.ffn.post", lambda y, name: seen.setdefault("post", y))])
    with torch.no_grad():
        expected = layer.experts[3](run.model.blocks[0].ffn_norm(seen["mid"]))
    torch.testing.assert_close(seen["post"], expected, rtol=0, atol=1e-6)


def test_probe_experts_prints_and_writes_json(qwen3_moe, tmp_path):
    model, run = qwen3_moe
    from qkv.data.tokenizer import Tokenizer
    import dataclasses

    from qkv.formats.gguf import save

    tokenizer = Tokenizer.train(["To be, or not to be"] * 5, 300)
    bigger = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**model.config.to_dict(), "vocab_size": 300, "mlp_only_layers": []}))
    bigger.save_pretrained(tmp_path / "hf")
    path = save(dataclasses.replace(qkv.load(tmp_path / "hf"), tokenizer=tokenizer), tmp_path / "m.gguf")
    code, out, err = cli("probe", str(path), "--text", "To be or", "--experts", "--json")
    assert code == 0, err
    found = json.loads(out)
    assert len(found["experts"]) == 3 and len(found["experts"][0]["experts"]) == len(found["tokens"])
    code, out, _ = cli("probe", str(path), "--text", "To be or", "--experts")
    assert code == 0 and "blocks.2.ffn.gates" in out and "load" in out
    dense = tmp_path / "dense"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32,
                                                           num_hidden_layers=1, num_attention_heads=2)).save_pretrained(dense)
    dense_path = save(dataclasses.replace(qkv.load(dense), tokenizer=tokenizer), tmp_path / "d.gguf")
    code, _, err = cli("probe", str(dense_path), "--text", "To be", "--experts")
    assert code == 2 and "no mixture-of-experts layer" in err and err.count("\n") == 1, err
