"""Run dirs: `qkv.load` rebuilds exactly the trained model, reads without writing, and refuses bad dirs."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from qkv.errors import QkvError
from qkv.models import build_model
from qkv.formats import load
from qkv import files
from qkv.files import MODEL_FILE, read_tensors
from tests.train import setup_env, trained_run


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path_factory):
    setup_env(monkeypatch, tmp_path_factory)


@pytest.fixture
def run_copy(tmp_path_factory, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained_run(tmp_path_factory)[0], copy)
    return copy


def test_load_rebuilds_the_saved_weights(run_copy):
    run = load(run_copy)
    saved = read_tensors(run_copy / MODEL_FILE)
    for name, p in run.model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    assert not run.model.training and run.config.model.vocab_size == run.tokenizer.vocab_size
    text = "Thou art more fair"
    assert run.tokenizer.decode(run.tokenizer.encode(text)) == text
    assert run.model(torch.tensor([[run.tokenizer.eos_id]])).shape[-1] == run.config.model.vocab_size


def test_load_reads_a_committed_set_and_never_touches_staging(run_copy):
    """A trainer may be mid-save: `.staging` is being written and must survive a reader; a `.commit`
    not yet moved into place holds the newest weights."""
    staging, commit = run_copy / ".staging", run_copy / ".commit"
    staging.mkdir()
    (staging / MODEL_FILE).write_bytes(b"half written")
    commit.mkdir()
    newer = build_model(load(run_copy).config.model)  # different weights from the trained ones
    save_file(files.model_tensors(newer), str(commit / MODEL_FILE))
    run = load(run_copy)
    for name, p in newer.named_parameters():
        assert torch.equal(run.model.get_parameter(name).detach(), p.detach()), name
    assert (staging / MODEL_FILE).read_bytes() == b"half written" and (commit / MODEL_FILE).is_file()


def test_bad_run_dirs(tmp_path, run_copy):
    with pytest.raises(QkvError, match="no such run directory"):
        load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QkvError, match="not a qkv run"):
        load(tmp_path / "empty")
    data = (run_copy / MODEL_FILE).read_bytes()
    (run_copy / MODEL_FILE).write_bytes(data[:100])
    with pytest.raises(QkvError, match="not a readable safetensors file"):
        load(run_copy)
    (run_copy / MODEL_FILE).unlink()
    with pytest.raises(QkvError, match="no checkpoint yet"):
        load(run_copy)


def test_formats_save_writes_each_format_that_writes_and_names_the_rest(tmp_path):
    """qkv.formats.save: a run written as a run dir and as a GGUF file reads back with the same logits; an
    unknown format is one error that lists the formats."""
    import qkv
    from qkv import formats
    from tests.formats.gguf.test_writer import qkv_run

    run = qkv_run(tmp_path, "llama")
    ids = torch.tensor([[run.tokenizer.eos_id, 5, 6, 7]])
    with torch.no_grad():
        expected = run.model(ids)
        for name, out in (("run", tmp_path / "again"), ("gguf", tmp_path / "m.gguf")):
            assert torch.equal(qkv.load(formats.save(run, out, name)).model(ids), expected)
    with pytest.raises(QkvError, match="choose from: gguf, hf, run"):
        formats.save(run, tmp_path / "x", "onnx")


@pytest.mark.parametrize("overrides", [
    dict(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, n_kv_heads=2,
         tie_embeddings=False),
    dict(positional="learned", tie_embeddings=True),
    dict(positional="sinusoidal", moe_experts=4, moe_top_k=2),
    dict(positional="alibi"),  # a buffer: built on the device and copied into
    dict(positional="t5", arch="encoder-decoder"),
    dict(arch="encoder", head="mlm", type_vocab_size=2, norm_placement="post"),
], ids=["llama", "gpt", "moe", "alibi", "t5", "bert"])
def test_every_family_loads_its_saved_weights_and_logits(run_copy, tmp_path, overrides):
    """A model built on the meta device and given the file's tensors (run_dir.plain_model), or built and copied
    into where it has buffers, gives the saved model's logits exactly; no parameter or buffer left on meta."""
    import dataclasses

    from qkv.formats.base import Run
    from qkv.formats.run_dir import save

    base = load(run_copy)
    cfg = dataclasses.replace(base.config.model, d_model=32, n_heads=4, d_ff=64, n_layers=2, **overrides)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    out = save(Run(path=run_copy, config=dataclasses.replace(base.config, model=cfg), model=model,
                   tokenizer=base.tokenizer, chat=base.chat), tmp_path / "family")
    loaded = load(out).model
    assert not any(t.is_meta for t in (*loaded.parameters(), *loaded.buffers()))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    saved, read = model.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys() and all(torch.equal(saved[k], read[k]) for k in saved)  # exactly
    with torch.no_grad():
        args = (ids, ids) if cfg.arch == "encoder-decoder" else (ids,)
        want, got = model(*args), loaded(*args)
    # the same weights, their logits to fp32's last bits: MKL's sums on an AVX2 CPU follow where a tensor sits in
    # memory (a memory-mapped file's against a fresh allocation: 1.5e-8 on the MoE model)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_one_tensor_given_to_two_untied_parameters_becomes_two():
    """model_with assigns the file's tensors rather than copying them: where a mapping gives one tensor to two
    parameters that are not tied (T5's shared embedding), each still gets a storage of its own."""
    import dataclasses

    from qkv.config import ModelConfig
    from qkv.formats.base import model_with

    cfg = dataclasses.replace(ModelConfig(), vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                              max_seq_len=16, tie_embeddings=False)
    tensors = files.model_tensors(build_model(cfg))
    tensors["lm_head.weight"] = tensors["tok_emb.weight"]
    model = model_with(cfg, tensors, "test")
    head, embedding = model.lm_head.weight, model.tok_emb.weight
    assert torch.equal(head, embedding) and head.data_ptr() != embedding.data_ptr()
    with torch.no_grad():
        head.add_(1.0)
    assert torch.equal(embedding, tensors["tok_emb.weight"])


def test_weights_written_in_place_never_reach_the_file(run_copy):
    """The loaded weights are the file's tensors (safetensors maps the file privately): training or merging into
    them in place copies the pages it writes and leaves model.safetensors as it was."""
    before = (run_copy / MODEL_FILE).read_bytes()
    run = load(run_copy)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    assert (run_copy / MODEL_FILE).read_bytes() == before
    assert all(torch.equal(p.detach(), saved + 1.0) for p, saved in
               zip(run.model.parameters(), (read_tensors(run_copy / MODEL_FILE)[n] for n, _ in
                                             run.model.named_parameters())))
