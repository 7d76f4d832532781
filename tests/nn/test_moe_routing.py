"""Each family's MoE layer (qkv.nn.moe's routing) against transformers' own block built from its config: Mixtral,
Qwen3-MoE (with and without norm_topk_prob), OLMoE, DeepSeek-V2 (groups by their best score, a scale, a shared
expert) and DeepSeek-V3 (sigmoid scores, a choosing bias, groups by their two best), in float64."""
import pytest
import torch

pytest.importorskip("transformers")

from qkv.nn.moe import MoE, Routing  # noqa: E402

D, F_, E, K = 16, 12, 8, 2


def families():
    from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=D, num_experts_per_tok=K, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4)
    deepseek = dict(common, moe_intermediate_size=F_, n_routed_experts=E, n_shared_experts=2, n_group=4,
                    topk_group=2, routed_scaling_factor=2.5)
    return {
        "mixtral": (MixtralSparseMoeBlock(MixtralConfig(**common, intermediate_size=F_, num_local_experts=E)),
                    Routing(), 0),
        "qwen3_moe_norm": (Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common, moe_intermediate_size=F_, num_experts=E,
                                                                 norm_topk_prob=True)), Routing(), 0),
        "qwen3_moe": (Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common, moe_intermediate_size=F_, num_experts=E,
                                                            norm_topk_prob=False)), Routing(normalize=False), 0),
        "olmoe": (OlmoeSparseMoeBlock(OlmoeConfig(**common, intermediate_size=F_, num_experts=E)),
                  Routing(normalize=False), 0),
        "deepseek_v2": (DeepseekV2Moe(DeepseekV2Config(**deepseek, topk_method="group_limited_greedy")),
                        Routing(normalize=False, scale=2.5, groups=4, group_top_k=2), 2 * F_),
        "deepseek_v3": (DeepseekV3MoE(DeepseekV3Config(**deepseek, norm_topk_prob=True)),
                        Routing(scoring="sigmoid", scale=2.5, groups=4, group_top_k=2), 2 * F_),
    }


def qkv_twin(block, routing: Routing, shared: int) -> MoE:
    """qkv's MoE holding the block's weights: the stacked experts (gate and up in one (E, 2F, D) tensor) split
    into each expert's three matrices."""
    gate = getattr(block, "gate")
    bias = getattr(gate, "e_score_correction_bias", None)
    layer = MoE(D, F_, experts=E, top_k=K, ffn="glu", activation="silu", bias=False, routing=routing,
                choice_bias=bias is not None, shared_d_ff=shared).double()
    with torch.no_grad():
        layer.router.weight.copy_(gate.weight)
        if bias is not None:
            layer.router_bias.copy_(bias)
        for e, expert in enumerate(layer.experts):
            g, u = block.experts.gate_up_proj[e].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(g)
            expert.up_proj.weight.copy_(u)
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
        if shared:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.shared, name).weight.copy_(getattr(block.shared_experts, name).weight)
    return layer


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_norm", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"])
def test_each_family_routes_as_transformers_block(family):
    torch.manual_seed(0)
    block, routing, shared = families()[family]
    block = block.double().eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "gate.weight" in name else 0.3))  # clear router margins
        if getattr(block.gate, "e_score_correction_bias", None) is not None:
            block.gate.e_score_correction_bias.copy_(torch.rand(E) * 0.2)  # it moves the choice, not the gates
    layer = qkv_twin(block, routing, shared)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    with torch.no_grad():
        expected = block(x)
        got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # (transformers routes in float32)
    if family == "deepseek_v3":  # the bias chose: without it another expert wins somewhere
        layer.router_bias.zero_()
        assert (layer(x) - expected).abs().max() > 1e-3
