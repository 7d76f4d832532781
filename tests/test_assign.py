"""qkv.files.assign_model_tensors: a model built on the meta device takes the loaded tensors as its weights
without a copy, tied weights tied again, every name and shape checked as load_model_tensors checks them."""
import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.files import assign_model_tensors, model_tensors
from qkv.models import build_model

CFG = ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64, max_seq_len=32,
                  positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False)


def test_assigned_weights_are_the_tensors_themselves_and_stay_tied():
    torch.manual_seed(0)
    source = build_model(CFG).eval()
    tensors = model_tensors(source)
    with torch.device("meta"):
        model = build_model(CFG)
    assign_model_tensors(model, tensors, "test")
    assert model.tok_emb.weight.data_ptr() == tensors["tok_emb.weight"].data_ptr()  # no copy
    assert model.lm_head.weight is model.tok_emb.weight  # tied again
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), source(ids))


def test_a_missing_or_misshapen_tensor_is_named():
    tensors = model_tensors(build_model(CFG))
    for broken, message in (({k: v for k, v in tensors.items() if k != "final_norm.weight"}, "missing tensor"),
                            ({**tensors, "final_norm.weight": torch.ones(5)}, "has shape"),
                            ({**tensors, "final_norm.weight": torch.ones(32, dtype=torch.int64)}, "floating point")):
        with torch.device("meta"):
            model = build_model(CFG)
        with pytest.raises(QkvError, match=message):
            assign_model_tensors(model, broken, "file.gguf")
