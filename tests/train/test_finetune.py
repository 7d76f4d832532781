"""Fine-tuning from another run (qkv.train.finetune): the backbone's tensors are copied by name and shape,
only the new head (`head.*`) may be missing, and anything else missing or mis-shaped is one error."""
import dataclasses

import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.train.finetune import load_backbone, model_from_init

MLM = ModelConfig(arch="encoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=12,
                  head="mlm")
CLASSIFIER = dataclasses.replace(MLM, head="classifier", n_classes=3, labels=("a", "b", "c"))


def test_the_backbone_is_copied_and_the_new_head_kept():
    torch.manual_seed(0)
    source = build_model(MLM)
    torch.manual_seed(1)
    model = build_model(CLASSIFIER)
    head = {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("head.")}
    copied, fresh = load_backbone(model, source, "run")
    source_tensors = dict(source.named_parameters())
    backbone = [name for name, _ in model.named_parameters() if not name.startswith("head.")]
    assert copied == len(backbone) and fresh == len(head) and head
    for name, param in model.named_parameters():
        if name.startswith("head."):
            assert torch.equal(param, head[name])  # the new task's head starts fresh
        else:
            assert torch.equal(param, source_tensors[name])


def test_a_mismatched_backbone_is_one_error():
    wide = build_model(dataclasses.replace(MLM, d_model=32, n_heads=2))
    with pytest.raises(QkvError, match="has shape"):
        load_backbone(build_model(CLASSIFIER), wide, "run")
    decoder = build_model(dataclasses.replace(MLM, arch="decoder", head="none"))
    with pytest.raises(QkvError, match="has no tensor"):
        load_backbone(build_model(CLASSIFIER), decoder, "run")
    with pytest.raises(QkvError, match="model.arch='decoder' run"):
        model_from_init(CLASSIFIER, dataclasses.replace(MLM, arch="decoder"), "run")


def test_the_fine_tuned_model_takes_the_init_sizes_and_its_own_head():
    big = dataclasses.replace(MLM, d_model=32, n_layers=3, dropout=0.3)
    merged = model_from_init(dataclasses.replace(CLASSIFIER, dropout=0.1), big, "run")
    assert (merged.d_model, merged.n_layers) == (32, 3)
    assert (merged.head, merged.n_classes, merged.labels, merged.dropout) == ("classifier", 3, ("a", "b", "c"), 0.1)
