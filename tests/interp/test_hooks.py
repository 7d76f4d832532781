"""Hook points (qkv.nn.hookpoints) and qkv.interp, against identities the math guarantees and against transformers
on the same weights: identity hooks change nothing bitwise; patching resid_pre at layer 0 from the clean run
gives the clean run; zero-ablating a head equals removing its columns of W^O; the cached residual streams and
attention patterns of an imported LLaMA and GPT-2 equal transformers' hidden states and attentions; the logit
lens's last row is the model's output; hooks compose with KV-cached generation."""
import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.generate import generate
from qkv.interp import logit_lens, patch_from, run_with_cache, run_with_hooks, zero_head
from qkv.models import build_model
from qkv.nn.hookpoints import hook_names, hooked

LLAMA = ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_kv_heads=2, n_layers=3, d_ff=64, max_seq_len=64,
                    positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, dropout=0.0)
GPT2 = ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=3, d_ff=64, max_seq_len=64, dropout=0.0)
GEMMA = ModelConfig(**{**LLAMA.__dict__, "norm_placement": "sandwich", "embed_scale": True, "qk_norm": True,
                       "layer_types": ("sliding", "global", "nope"), "sliding_window": 4, "head_size": 12})
GPT2_SANDWICH = ModelConfig(**{**GPT2.__dict__, "norm_placement": "sandwich"})  # LayerNorm outer norms, biases


def model_of(cfg):
    torch.manual_seed(0)
    return build_model(cfg).eval()


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_identity_hooks_everywhere_leave_the_logits_bitwise_equal(cfg):
    model = model_of(cfg)
    ids = torch.randint(0, 97, (2, 10))
    names = hook_names(model)
    assert {"embed", "blocks.0.resid_pre", "blocks.2.attn.pattern", "blocks.1.ffn.pre", "final_norm",
            "logits"} <= set(names)
    seen = []
    with torch.no_grad():
        plain = model(ids)
        hooked_logits = run_with_hooks(model, ids, [(n, lambda x, name: seen.append(name)) for n in names
                                                    if not n.endswith(("scores", "pattern"))])
    assert torch.equal(plain, hooked_logits)
    assert len(seen) == len(names) - 6  # every point but the scores and patterns ran once
    with torch.no_grad():  # forming S and A explicitly: the same logits up to the kernels' rounding
        with_pattern = run_with_hooks(model, ids, [(n, lambda x, name: x) for n in names])
    assert torch.allclose(plain, with_pattern, atol=1e-5)


def test_unknown_point_names_are_refused_with_the_list():
    with pytest.raises(QkvError, match="no hook point blocks.9.resid_pre"):
        run_with_hooks(model_of(LLAMA), torch.zeros(1, 3, dtype=torch.long), [("blocks.9.resid_pre", print)])


def test_patching_resid_pre_of_layer_0_turns_the_corrupted_run_into_the_clean_one():
    model = model_of(LLAMA)
    clean, corrupted = torch.randint(0, 97, (1, 8)), torch.randint(0, 97, (1, 8))
    clean_logits, cache = run_with_cache(model, clean, ["blocks.0.resid_pre", "blocks.1.resid_post"])
    patched = run_with_hooks(model, corrupted, [("blocks.0.resid_pre", patch_from(cache))])
    assert torch.allclose(patched, clean_logits, atol=1e-6)
    # one position only: the positions before it are unchanged (causal), the ones from it on move
    partial = run_with_hooks(model, corrupted, [("blocks.0.resid_pre", patch_from(cache, [5]))])
    corrupted_logits = run_with_hooks(model, corrupted, [])
    assert torch.allclose(partial[:, :5], corrupted_logits[:, :5], atol=1e-6)
    assert not torch.allclose(partial[:, 5:], corrupted_logits[:, 5:], atol=1e-3)


def test_zero_ablating_a_head_equals_removing_its_columns_of_w_o():
    model = model_of(GPT2)
    ids = torch.randint(0, 97, (2, 9))
    ablated = run_with_hooks(model, ids, [("blocks.1.attn.z", zero_head(2))])
    edited = model_of(GPT2)
    with torch.no_grad():
        edited.blocks[1].attn.o_proj.weight[:, 2 * 8:3 * 8] = 0  # head 2's Dh = 8 columns
        assert torch.allclose(edited(ids), ablated, atol=1e-6)


def test_the_logit_lens_last_row_is_the_models_own_prediction():
    model = model_of(LLAMA)
    ids = torch.randint(0, 97, (1, 7))
    rows = logit_lens(model, ids)
    with torch.no_grad():
        probs = model(ids)[0, -1].softmax(-1)
    assert [r["layer"] for r in rows] == [0, 1, 2, 3] and rows[0]["point"] == "embed"
    assert rows[-1]["target_rank"] == 0 and rows[-1]["top"][0][0] == int(probs.argmax())
    assert abs(rows[-1]["target_prob"] - float(probs.max())) < 1e-6


def test_hooks_compose_with_the_kv_cache_during_generation():
    """Steering: a vector added to blocks.1.resid_post at every step of a cached generate gives the tokens of
    argmax over full forwards with the same hook (no cache)."""
    model = model_of(LLAMA)
    torch.manual_seed(1)
    vector = torch.randn(32) * 3
    steer = [("blocks.1.resid_post", lambda x, name: x + vector)]
    prompt = torch.randint(0, 97, (1, 4))
    with torch.no_grad(), hooked(model, steer):
        cached = generate(model, prompt, max_new_tokens=8)
        ids = prompt
        for _ in range(8):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, ids)
    with torch.no_grad():
        assert not torch.equal(generate(model, prompt, max_new_tokens=8), cached)  # the hook did something


# ------------------------------------------------------------------------ against transformers (same weights)
transformers = pytest.importorskip("transformers")


def hf_pair(tmp_path, family: str):
    from qkv.formats import load

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attn_implementation="eager")
        hf = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                         attn_implementation="eager")
        hf = transformers.GPT2LMHeadModel(config)
    hf.eval().save_pretrained(tmp_path / family)
    return hf, load(tmp_path / family).model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_residual_streams_and_patterns_equal_transformers(tmp_path, family):
    hf, model = hf_pair(tmp_path, family)
    ids = torch.randint(0, 97, (2, 11))
    names = [f"blocks.{i}.resid_pre" for i in range(3)] + ["final_norm"] + [f"blocks.{i}.attn.pattern" for i in range(3)]
    logits, cache = run_with_cache(model, ids, names)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True, output_attentions=True)
    assert torch.allclose(logits, out.logits, atol=1e-4)
    for i in range(3):  # hidden_states[i] enters layer i; the last one is after the final norm
        assert torch.allclose(cache[f"blocks.{i}.resid_pre"], out.hidden_states[i], atol=1e-5), i
        assert torch.allclose(cache[f"blocks.{i}.attn.pattern"], out.attentions[i], atol=1e-5), i
    assert torch.allclose(cache["final_norm"], out.hidden_states[3], atol=1e-5)


def test_head_scores_find_a_previous_token_head_and_an_induction_head_made_by_hand():
    """A pattern hook that makes head 1 of layer 0 attend to the previous token, and head 0 of layer 1 to the
    key after the query's earlier occurrence: the scores find exactly those heads (1.0) among the others."""
    from qkv.interp import head_scores, induction_scores

    model = model_of(GPT2)
    n = 10

    def previous(a, name):  # head 1: each query on the key before it (the first on itself)
        a = a.clone()
        t = a.shape[-1]
        a[:, 1] = 0
        a[:, 1, 0, 0] = 1.0
        a[:, 1, torch.arange(1, t), torch.arange(0, t - 1)] = 1.0
        return a

    def induction(a, name):  # head 0, on R R only: each query of the second R on the key after its twin
        if a.shape[-1] != 2 * n:
            return None
        a = a.clone()
        q = torch.arange(n, 2 * n)
        a[:, 0, q] = 0
        a[:, 0, q, q - n + 1] = 1.0
        return a

    with hooked(model, [("blocks.0.attn.pattern", previous), ("blocks.1.attn.pattern", induction)]):
        scores = head_scores(model, torch.randint(0, 97, (1, 12)))
        ind = induction_scores(model, 97, length=n)
    assert scores["previous_token"][0][1] == pytest.approx(1.0)
    assert max(s for i, layer in enumerate(scores["previous_token"]) for h, s in enumerate(layer)
               if (i, h) != (0, 1)) < 0.9
    assert ind[1][0] == pytest.approx(1.0) and max(ind[2]) < 0.9
    assert all(0.0 <= s <= 1.0 for layer in scores["first_token"] for s in layer)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, GEMMA, GPT2_SANDWICH],
                         ids=["llama-rmsnorm", "gpt2-layernorm", "gemma-sandwich", "layernorm-sandwich"])
def test_direct_attributions_add_up_to_the_logit(cfg):
    """The sum of every component's direct term (embedding, each head, each output bias, each FFN) and the
    norms' and head's biases is the target's logit, with the final norm's scale frozen, and a sandwich block's
    outer norms' (1e-4)."""
    from qkv.interp import direct_logit_attribution

    model = model_of(cfg)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial gains and biases
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 97, (1, 9))
    result = direct_logit_attribution(model, ids, target=11)
    total = sum(t for _, t in result["components"]) + result["constant"]
    assert total == pytest.approx(result["logit"], abs=1e-4)
    assert len([n for n, _ in result["components"] if ".attn.head" in n]) == 3 * 4
    # the biggest head, ablated, moves the logit (direct effect plus what later layers make of it)
    name, value = max(((n, t) for n, t in result["components"] if ".attn.head" in n), key=lambda c: abs(c[1]))
    layer, head = int(name.split(".")[1]), int(name.rsplit("head", 1)[1])
    ablated = run_with_hooks(model, ids, [(f"blocks.{layer}.attn.z", zero_head(head))])[0, -1, 11]
    assert float(ablated) != pytest.approx(result["logit"], abs=1e-6)


def test_direct_attribution_refuses_post_ln():
    from qkv.interp import direct_logit_attribution

    model = model_of(ModelConfig(**{**GPT2.__dict__, "norm_placement": "post"}))
    with pytest.raises(QkvError, match="Pre-LN or sandwich"):
        direct_logit_attribution(model, torch.randint(0, 97, (1, 5)))


def test_patching_map_recovers_everything_at_the_last_resid_post_and_nothing_before_the_change():
    from qkv.interp import patching_map

    model = model_of(LLAMA)
    clean = torch.randint(0, 97, (1, 7))
    corrupted = clean.clone()
    corrupted[0, 3] = (clean[0, 3] + 5) % 97  # one token differs
    with torch.no_grad():
        logits = model(clean)[0, -1]
    answer, wrong = int(logits.argmax()), int(logits.argmin())
    found = patching_map(model, clean, corrupted, answer=answer, wrong=wrong)
    rows = found["recovered"]
    assert len(rows) == 4 and len(rows[0]) == 7
    assert rows[-1][-1] == pytest.approx(1.0, abs=1e-5)  # the last resid_post at the last position: all of it
    assert rows[0][3] == pytest.approx(1.0, abs=1e-5)  # block 0's input at the changed token: the clean run
    assert all(abs(rows[0][t]) < 1e-5 for t in range(7) if t != 3)  # the same tokens elsewhere: nothing to patch
    with pytest.raises(QkvError, match="one length"):
        patching_map(model, clean, clean[:, :5], answer=answer, wrong=wrong)


def test_every_head_ffn_and_the_embedding_patched_from_clean_is_the_clean_run():
    """A Pre-LN stream is embed + the sublayers' outputs: with the embedding, every head's z and every FFN's output
    taken from the clean run, the corrupted run is the clean one; the head map of a one-head change is 1.0 there."""
    from qkv.interp import head_patching_map, patch_head_from

    model = model_of(LLAMA)
    clean, corrupted = torch.randint(0, 97, (1, 8)), torch.randint(0, 97, (1, 8))
    names = ["embed"] + [f"blocks.{i}.{p}" for i in range(3) for p in ("attn.z", "ffn.post")]
    clean_logits, cache = run_with_cache(model, clean, names)
    patched = run_with_hooks(model, corrupted, [(n, patch_from(cache)) for n in names])
    assert torch.allclose(patched, clean_logits, atol=1e-5)
    with torch.no_grad():
        logits = model(clean)[0, -1]
    answer, wrong = int(logits.argmax()), int(logits.argmin())
    rows = head_patching_map(model, clean, corrupted, answer=answer, wrong=wrong)
    assert [len(r) for r in rows] == [4, 4, 4]
    # one entry recomputed by hand: layer 1, head 3
    diff = lambda out: float(out[0, -1, answer] - out[0, -1, wrong])  # noqa: E731
    low, high = diff(run_with_hooks(model, corrupted, [])), diff(clean_logits)
    z = run_with_cache(model, clean, ["blocks.1.attn.z"])[1]
    one = run_with_hooks(model, corrupted, [("blocks.1.attn.z", patch_head_from(z, 3))])
    assert rows[1][3] == pytest.approx((diff(one) - low) / (high - low), abs=1e-6)
    with pytest.raises(QkvError, match="nothing to recover"):
        head_patching_map(model, clean, clean, answer=answer, wrong=wrong)


def test_mean_ablation_keeps_the_heads_average():
    from qkv.interp import mean_head

    model = model_of(GPT2)
    ids = torch.randint(0, 97, (1, 9))
    _, cache = run_with_cache(model, ids, ["blocks.1.attn.z"])
    mean = cache["blocks.1.attn.z"][0, 3].mean(0)  # head 3's output averaged over positions
    seen = {}
    run_with_hooks(model, ids, [("blocks.1.attn.z", mean_head(mean, 3)),
                                ("blocks.1.attn.z", lambda z, name: seen.setdefault("z", z))])
    assert torch.allclose(seen["z"][0, 3], mean.expand(9, -1)) and torch.equal(seen["z"][0, 2], cache["blocks.1.attn.z"][0, 2])


def test_an_encoder_decoders_points_equal_transformers_bart(tmp_path):
    """A BART (Post-LN encoder-decoder) imported from transformers: every encoder block's input equals its
    encoder_hidden_states, the decoder's self-attention and cross-attention patterns (keys: the source) equal
    decoder_attentions and cross_attentions, and identity hooks at all 67 of its points change nothing."""
    from qkv.formats import load

    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, attn_implementation="eager")
    hf = transformers.BartForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path / "bart")
    model = load(tmp_path / "bart").model
    src, tgt = torch.randint(3, 97, (2, 9)), torch.randint(3, 97, (2, 6))
    names = (["encoder.embed", "encoder.final_norm", "embed"] + [f"encoder.blocks.{i}.resid_pre" for i in range(2)]
             + [f"blocks.{i}.{kind}.pattern" for i in range(2) for kind in ("attn", "cross_attn")])
    logits, cache = run_with_cache(model, src, names, tgt_ids=tgt)
    with torch.no_grad():
        out = hf(input_ids=src, decoder_input_ids=tgt, output_hidden_states=True, output_attentions=True)
    assert torch.allclose(logits, out.logits, atol=1e-4)
    assert torch.equal(cache["encoder.embed"], cache["encoder.blocks.0.resid_pre"])
    assert torch.allclose(cache["encoder.final_norm"], out.encoder_last_hidden_state, atol=1e-5)
    assert torch.allclose(cache["embed"], out.decoder_hidden_states[0], atol=1e-5)
    for i in range(2):
        assert torch.allclose(cache[f"encoder.blocks.{i}.resid_pre"], out.encoder_hidden_states[i], atol=1e-5), i
        assert torch.allclose(cache[f"blocks.{i}.attn.pattern"], out.decoder_attentions[i], atol=1e-5), i
        assert cache[f"blocks.{i}.cross_attn.pattern"].shape == (2, 4, 6, 9)
        assert torch.allclose(cache[f"blocks.{i}.cross_attn.pattern"], out.cross_attentions[i], atol=1e-5), i
    names = hook_names(model)
    assert len(names) == 67
    assert {"encoder.final_norm", "logits", "encoder.blocks.1.attn.scores", "blocks.1.cross_attn.v"} <= set(names)
    cheap = [n for n in names if not n.endswith(("scores", "pattern"))]
    seen = []
    with torch.no_grad():
        plain = model(src, tgt_ids=tgt)
        hooked_logits = run_with_hooks(model, src, [(n, lambda x, name: seen.append(name)) for n in cheap],
                                       tgt_ids=tgt)
        with_pattern = run_with_hooks(model, src, [(n, lambda x, name: x) for n in names], tgt_ids=tgt)
    assert torch.equal(plain, hooked_logits) and sorted(seen) == sorted(cheap)
    assert torch.allclose(plain, with_pattern, atol=1e-5)  # S and A formed explicitly: rounding only


def test_the_scores_are_q_k_over_sqrt_dh_masked_and_the_pattern_is_their_softmax():
    """blocks.i.attn.scores against Q K^T / sqrt(Dh) from the cached q and k (grouped K/V repeated, -inf above
    the diagonal), and the cached pattern against its softmax (note 000 §2.1.3)."""
    model = model_of(LLAMA)
    ids = torch.randint(0, 97, (2, 7))
    _, cache = run_with_cache(model, ids, ["blocks.1.attn.q", "blocks.1.attn.k", "blocks.1.attn.scores",
                                           "blocks.1.attn.pattern"])
    q, k = cache["blocks.1.attn.q"], cache["blocks.1.attn.k"].repeat_interleave(2, dim=1)  # 4 heads, 2 K/V heads
    expected = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    expected = expected.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(cache["blocks.1.attn.scores"], expected, atol=1e-5)
    assert torch.allclose(cache["blocks.1.attn.scores"].softmax(-1), cache["blocks.1.attn.pattern"], atol=1e-6)


def test_knocking_out_a_key_renormalises_the_querys_row_and_changes_nothing_before_it():
    """knock_out(query, [key]): the query's pattern row is the old row without the key, divided by 1 - a_key
    (the softmax over the remaining keys); earlier positions' logits are bitwise unchanged; a query left with
    no key is refused."""
    from qkv.interp import knock_out

    model = model_of(LLAMA)
    ids = torch.randint(0, 97, (1, 8))
    plain, before = run_with_cache(model, ids, ["blocks.2.attn.pattern"])
    with hooked(model, [("blocks.2.attn.scores", knock_out(7, [0, 3], heads=[1]))]):  # caches what it made
        logits, after = run_with_cache(model, ids, ["blocks.2.attn.pattern"])
    a, b = before["blocks.2.attn.pattern"][0], after["blocks.2.attn.pattern"][0]  # (H, T, T)
    expected = a[1, 7].clone()
    expected[[0, 3]] = 0
    assert torch.allclose(b[1, 7], expected / (1 - a[1, 7, 0] - a[1, 7, 3]), atol=1e-6)
    assert torch.allclose(b[0], a[0], atol=1e-6) and torch.allclose(b[1, :7], a[1, :7], atol=1e-6)
    assert torch.allclose(logits[0, :7], plain[0, :7], atol=1e-5) and not torch.allclose(logits[0, 7], plain[0, 7])
    with pytest.raises(QkvError, match="read no key"):
        run_with_hooks(model, ids[:, :3], [("blocks.0.attn.scores", knock_out(2, [0, 1, 2]))])
