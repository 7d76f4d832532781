"""KV-cached decoding against full recomputation, beam search against exhaustive search, batching,
seeds, stop tokens and the context limit, for every positional encoding in the registry."""
import importlib.util
import itertools
import warnings
from pathlib import Path

import pytest
import torch

import qkv
from qkv.errors import QkvError
from qkv.generate import PromptTruncatedWarning, beam_search, generate, pad_left
from qkv.nn.positional import POSITIONALS

POSITIONAL_NAMES = POSITIONALS.names()
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "generate.py"


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a shared, loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(positional: str = "rope", vocab: int = 64, seed: int = 0, **overrides) -> torch.nn.Module:
    """init_std 0.3 gives peaked next-token distributions, so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    cfg = qkv.ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32,
                          positional=positional, **{"init_std": 0.3, **overrides})
    return qkv.build_model(cfg).eval()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits of an unpadded sequence by one full forward, no cache. (V,)"""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


# cached step logits == full recomputation, every positional and family: test_families.py


def greedy_by_recomputation(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(full_logits(model, ids).argmax()))
    return ids


@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_greedy_with_cache_equals_greedy_by_full_recomputation(positional):
    model = tiny_model(positional)
    prompt = [3, 14, 15, 9, 2, 6]
    out = generate(model, torch.tensor([prompt]), max_new_tokens=26)  # fills max_seq_len exactly
    assert out[0].tolist() == greedy_by_recomputation(model, prompt, 26)


@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_left_padded_batch_equals_one_by_one(positional):
    model = tiny_model(positional)
    prompts = [[5, 9, 1], [7, 3, 3, 8, 2, 6, 4], [11], [2, 2, 40, 17]]
    ids, mask = pad_left(prompts, pad_id=0)
    batch = generate(model, ids, max_new_tokens=12, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=12)
        assert batch[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist()


def test_left_padded_beam_batch_equals_one_by_one():
    model = tiny_model("rope")
    prompts = [[5, 9, 1], [7, 3, 3, 8, 2, 6, 4]]
    ids, mask = pad_left(prompts, pad_id=0)
    batch = generate(model, ids, max_new_tokens=6, strategy="beam", num_beams=3, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        best = beam_search(model, torch.tensor(prompt), max_new_tokens=6, num_beams=3)[0]
        assert batch[row, ids.shape[1]:].tolist() == best.tokens.tolist()


@pytest.mark.parametrize("positional", ["learned", "alibi"])
def test_beam_width_one_is_greedy(positional):
    model = tiny_model(positional)
    ids = torch.tensor([[3, 14, 15], [9, 2, 6]])
    greedy = generate(model, ids, max_new_tokens=10)
    assert torch.equal(generate(model, ids, max_new_tokens=10, strategy="beam", num_beams=1), greedy)


def exhaustive(model, prompt: list[int], vocab: int, new: int) -> tuple[list[list[int]], torch.Tensor]:
    """Every continuation of exactly `new` tokens and its tokens' log-probabilities (V^new, new)."""
    continuations = torch.tensor(list(itertools.product(range(vocab), repeat=new)))  # (V^new, new)
    ids = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
    with torch.no_grad():
        log_probs = model(ids).log_softmax(-1)[:, len(prompt) - 1:-1]  # (V^new, new, V)
    return continuations.tolist(), log_probs.gather(-1, continuations[..., None])[..., 0].double()


@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_beam_search_equals_exhaustive_search(positional):
    """With K >= V^(new - 1) beams every prefix survives, so the K best are the true K best."""
    vocab, new = 5, 3
    model = tiny_model(positional, vocab=vocab)
    prompt = [1, 4, 2]
    continuations, log_probs = exhaustive(model, prompt, vocab, new)
    truth = sorted(zip(log_probs.sum(-1).tolist(), continuations), key=lambda pair: -pair[0])
    found = beam_search(model, torch.tensor(prompt), max_new_tokens=new, num_beams=vocab ** 2,
                        length_penalty=0.0)
    assert len(found) == vocab ** 2
    for hyp, (log_prob, tokens) in zip(found, truth):
        assert hyp.tokens.tolist() == tokens
        assert hyp.log_prob == pytest.approx(log_prob, abs=1e-5)
        assert hyp.score == pytest.approx(log_prob, abs=1e-5)  # length_penalty 0: score = log p
    best = generate(model, torch.tensor([prompt]), max_new_tokens=new, strategy="beam", num_beams=vocab ** 2,
                    length_penalty=0.0)
    assert best[0, len(prompt):].tolist() == truth[0][1]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, -0.5])
def test_beam_search_with_a_stop_token_equals_exhaustive_search(length_penalty):
    """Hypotheses end at the stop token or after 3 tokens, score = log p / n^alpha (n counts the stop).
    With K >= (V - 1)^2 every unstopped prefix survives, and the exact bound (early_stopping=False)
    ends nothing too soon, so the K best found are the K best of all."""
    vocab, new, stop = 5, 3, 0
    model = tiny_model("rope", vocab=vocab, seed=3)
    prompt = [1, 4, 2]
    continuations, log_probs = exhaustive(model, prompt, vocab, new)
    scores = {}
    for tokens, token_log_probs in zip(continuations, log_probs):
        n = tokens.index(stop) + 1 if stop in tokens else new
        scores[tuple(tokens[:n])] = float(token_log_probs[:n].sum()) / n ** length_penalty
    truth = sorted(scores.items(), key=lambda item: -item[1])[:vocab ** 2]
    found = beam_search(model, torch.tensor(prompt), max_new_tokens=new, num_beams=vocab ** 2,
                        length_penalty=length_penalty, early_stopping=False, stop_tokens=[stop])
    assert [hyp.tokens.tolist() for hyp in found] == [list(tokens) for tokens, _ in truth]
    assert [hyp.score for hyp in found] == pytest.approx([score for _, score in truth], abs=1e-5)
    assert any(hyp.tokens[-1] == stop for hyp in found[:3])  # stopped hypotheses compete at the top


def test_seeds_reproduce_and_different_seeds_differ():
    model = tiny_model("rope", init_std=0.05)  # a flatter distribution, so draws vary
    ids = torch.tensor([[3, 14, 15], [9, 2, 6]])
    runs = {seed: generate(model, ids, 16, "sample", seed=seed) for seed in (0, 1, 2)}
    assert torch.equal(runs[0], generate(model, ids, 16, "sample", seed=0))
    assert not torch.equal(runs[0], runs[1]) and not torch.equal(runs[1], runs[2])
    for strategy in ("top-k", "top-p"):
        assert torch.equal(generate(model, ids, 8, strategy, seed=5), generate(model, ids, 8, strategy, seed=5))


def test_stop_tokens_stop_rows_and_then_pad():
    model = tiny_model("rope")
    ids = torch.tensor([[3, 14, 15], [9, 2, 6]])
    free = generate(model, ids, max_new_tokens=12)[:, 3:]  # (2, 12) without stop tokens
    stop = int(free[0, 2])
    assert stop not in free[1].tolist()  # row 1 never stops: it must be unaffected
    out = generate(model, ids, max_new_tokens=12, stop_tokens=[stop], pad_id=63)[:, 3:]
    first = free[0].tolist().index(stop)
    assert out[0, :first + 1].tolist() == free[0, :first + 1].tolist()
    assert out[0, first + 1:].tolist() == [63] * (11 - first)
    assert torch.equal(out[1], free[1])
    default_fill = generate(model, ids, max_new_tokens=12, stop_tokens=[stop])[0, 3:]
    assert default_fill[first:].tolist() == [stop] * (12 - first)  # without pad_id: the stop token


def test_generation_ends_when_every_row_stopped():
    model = tiny_model("rope")
    ids = torch.tensor([[3, 14, 15], [9, 2, 6]])
    free = generate(model, ids, max_new_tokens=12)[:, 3:]
    stops = {int(free[0, 1]), int(free[1, 3])}
    first = [next(i for i, token in enumerate(row) if token in stops) for row in free.tolist()]
    out = generate(model, ids, max_new_tokens=12, stop_tokens=sorted(stops))[:, 3:]
    assert out.shape == (2, max(first) + 1)  # ended early, after the last row's stop token
    for row in (0, 1):
        assert out[row, :first[row] + 1].tolist() == free[row, :first[row] + 1].tolist()
        assert set(out[row, first[row]:].tolist()) == {int(free[row, first[row]])}


def test_on_token_streams_the_returned_tokens():
    model = tiny_model("sinusoidal")
    ids = torch.tensor([[3, 14, 15], [9, 2, 6]])
    seen = []
    out = generate(model, ids, max_new_tokens=7, strategy="top-k", top_k=5, seed=3,
                   on_token=lambda step, tokens: seen.append((step, tokens.tolist())))
    assert [step for step, _ in seen] == list(range(7))
    assert torch.tensor([tokens for _, tokens in seen]).T.tolist() == out[:, 3:].tolist()


def test_long_prompt_keeps_its_last_tokens_and_warns_once():
    model = tiny_model("learned")  # max_seq_len 32: a learned table has no row 32
    prompt = torch.arange(40).remainder(64)[None]  # (1, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, prompt, max_new_tokens=10)
    assert [w.category for w in caught] == [PromptTruncatedWarning]
    assert out.shape == (1, 50) and torch.equal(out[:, :40], prompt)
    assert torch.equal(out[:, 40:], generate(model, prompt[:, -22:], max_new_tokens=10)[:, 22:])
    with pytest.warns(PromptTruncatedWarning, match="max_new_tokens=100 reduced to 31"):
        assert generate(model, prompt[:, :5], max_new_tokens=100).shape == (1, 5 + 31)


def test_dropout_is_off_during_generation_and_modes_are_restored():
    model = tiny_model("rope", dropout=0.5).train()
    model.blocks[0].eval()  # a mixed state must come back as it was
    ids = torch.tensor([[3, 14, 15]])
    out = generate(model, ids, max_new_tokens=8)
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    assert torch.equal(out, generate(model.eval(), ids, max_new_tokens=8))


def test_repetition_penalty_changes_greedy_choices_only_when_set():
    model = tiny_model("rope")
    ids = torch.tensor([[3, 14, 15]])
    plain = generate(model, ids, max_new_tokens=16)
    assert torch.equal(plain, generate(model, ids, max_new_tokens=16, repetition_penalty=1.0))
    penalised = generate(model, ids, max_new_tokens=16, repetition_penalty=50.0)[0, 3:].tolist()
    assert len(set(penalised)) > len(set(plain[0, 3:].tolist()))


def test_qkv_generate_is_decode_generate():
    model = tiny_model("rope")
    ids = torch.tensor([[3, 14, 15]])
    assert torch.equal(qkv.generate(model, ids, max_new_tokens=4), generate(model, ids, max_new_tokens=4))


def test_one_dimensional_prompt_gives_one_dimensional_output():
    model = tiny_model("rope")
    out = generate(model, torch.tensor([3, 14, 15]), max_new_tokens=4)
    assert out.tolist() == generate(model, torch.tensor([[3, 14, 15]]), max_new_tokens=4)[0].tolist()


def test_pad_left():
    ids, mask = pad_left([[1, 2], [3, 4, 5], [6]], pad_id=9)
    assert ids.tolist() == [[9, 1, 2], [3, 4, 5], [9, 9, 6]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "nucleus"}, "choose from"),
    ({"attention_mask": torch.tensor([[1, 1, 0]])}, "LEFT padding"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"strategy": "beam", "num_beams": 0}, "num_beams"),
    ({"strategy": "beam", "on_token": print}, "on_token"),
    ({"temperature": -1.0, "strategy": "sample"}, "temperature"),
])
def test_bad_arguments_are_errors_for_people(kwargs, message):
    with pytest.raises(QkvError, match=message):
        generate(tiny_model("rope"), torch.tensor([[3, 14, 15]]), **{"max_new_tokens": 2, **kwargs})


def hf_gpt2_pair(vocab: int = 50):
    """A tiny random GPT-2 from transformers and the same weights in qkv (benchmarks/generate.py maps them)."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_generate", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=vocab - 1)).eval()
    model = qkv.build_model(qkv.ModelConfig(
        vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=128, max_seq_len=32, positional="learned",
        norm="layernorm", norm_eps=1e-5, norm_placement="pre", activation="gelu_tanh", bias=True,
        tie_embeddings=True)).eval()
    bench.copy_gpt2_weights(hf, model)
    return hf, model


def test_greedy_matches_transformers_gpt2():
    hf, model = hf_gpt2_pair()
    ids = torch.tensor([[3, 14, 15, 9], [2, 6, 5, 35]])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(generate(model, ids, max_new_tokens=12), expected)


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, True), (2.0, True), (0.0, False), (-1.0, False)])
def test_beam_search_matches_transformers_gpt2(length_penalty, early_stopping):
    """early_stopping=False is our exact bound, which is transformers' early_stopping="never"."""
    hf, model = hf_gpt2_pair()
    ids = torch.tensor([[3, 14, 15, 9], [2, 6, 5, 35]])
    stop = int(generate(model, ids, max_new_tokens=3)[0, -1])  # a token the beams do meet
    kwargs = dict(max_new_tokens=7, num_beams=3, length_penalty=length_penalty)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=stop,
                               early_stopping=early_stopping or "never", num_return_sequences=3,
                               return_dict_in_generate=True, output_scores=True, **kwargs)
    best = generate(model, ids, strategy="beam", early_stopping=early_stopping, stop_tokens=[stop],
                    pad_id=49, **kwargs)
    assert torch.equal(best, expected.sequences[::3])
    for row in range(2):
        found = beam_search(model, ids[row], early_stopping=early_stopping, stop_tokens=[stop], **kwargs)
        theirs = expected.sequences[3 * row:3 * row + 3, 4:]
        for hyp, tokens, score in zip(found, theirs, expected.sequences_scores[3 * row:3 * row + 3]):
            assert hyp.tokens.tolist() == tokens[:len(hyp.tokens)].tolist()
            assert hyp.score == pytest.approx(float(score), rel=1e-6, abs=1e-5)


def test_decoding_linears_swap_shares_parameters_and_put_back(monkeypatch):
    from qkv.nn import decoding_linear
    from qkv.nn.decoding_linear import DecodingLinear, decoding_linears

    monkeypatch.setattr(decoding_linear, "left_form_faster", lambda dtype: True)  # where W x^T is measured the faster
    model = tiny_model()
    layers = {name: module for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    keys = list(model.state_dict())
    with pytest.raises(RuntimeError), decoding_linears(model):
        swapped = dict(model.named_modules())
        assert all(type(swapped[name]) is DecodingLinear and swapped[name].weight is layer.weight
                   for name, layer in layers.items())
        assert list(model.state_dict()) == keys  # same names, same (tied) parameters
        raise RuntimeError("a failing step")
    assert all(dict(model.named_modules())[name] is layer for name, layer in layers.items())  # restored
    ids = torch.tensor([[3, 5, 7, 9]])
    out = generate(model, ids, max_new_tokens=6, strategy="greedy")
    assert all(dict(model.named_modules())[name] is layer for name, layer in layers.items())
    assert out[0, 4:].tolist() == greedy_by_full_recomputation(model, ids[0].tolist(), 6)
    with decoding_linears(model):  # made once per layer and kept: the same stand-ins each call
        first = {name: m for name, m in model.named_modules() if type(m) is DecodingLinear}
    layers["blocks.0.attn.o_proj"].weight = torch.nn.Parameter(layers["blocks.0.attn.o_proj"].weight.clone())
    with decoding_linears(model):  # ... but made anew for a layer given a new weight
        again = {name: m for name, m in model.named_modules() if type(m) is DecodingLinear}
    assert first.keys() == again.keys() and len(first) == len(layers)
    assert [name for name in first if again[name] is not first[name]] == ["blocks.0.attn.o_proj"]
    assert again["blocks.0.attn.o_proj"].weight is layers["blocks.0.attn.o_proj"].weight


def test_where_nn_linear_is_the_faster_form_no_layer_takes_the_other(monkeypatch):
    """Where nn.Linear's x W^T is the faster decode form (qkv.nn.forms measures it per machine), the swapped-in
    layers (and the fused projections) multiply as nn.Linear does, never as W x^T; where W x^T is the faster,
    they take it; generation is the same greedy text either way."""
    from qkv.nn import decoding_linear, fuse
    from qkv.nn.decoding_linear import DecodingLinear, decoding_linears

    left_calls = []
    left_product = decoding_linear.left_product
    monkeypatch.setattr(decoding_linear, "left_product", lambda *a: left_calls.append(1) or left_product(*a))
    ids = torch.tensor([[3, 5, 7, 9]])
    for faster in (False, True):
        monkeypatch.setattr(decoding_linear, "left_form_faster", lambda dtype: faster)
        model = tiny_model()
        with decoding_linears(model):
            assert all(type(m) is not torch.nn.Linear for m in model.modules())  # every layer swapped
        layer = torch.nn.Linear(8, 6)
        assert type(fuse.fuse_linear([layer, torch.nn.Linear(8, 4)])) is DecodingLinear
        left_calls.clear()
        assert generate(model, ids, max_new_tokens=6, strategy="greedy")[0, 4:].tolist() == \
            greedy_by_full_recomputation(model, ids[0].tolist(), 6)
        assert bool(left_calls) is faster


def greedy_by_full_recomputation(model, ids: list[int], new: int) -> list[int]:
    """Greedy continuation without a cache and through the model's own nn.Linear head."""
    out = []
    with torch.no_grad():
        for _ in range(new):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
    return out
