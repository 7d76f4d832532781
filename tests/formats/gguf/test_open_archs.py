"""GGUF files of the newer architectures, written here with the `gguf` package as llama.cpp's converter lays them
out (convert_hf_to_gguf.py: its tensor names, Gemma's norms stored as 1 + w, Llama 3.x's scaling as a
rope_freqs.weight tensor), from random transformers models: qwen3 and gemma3 read by qkv with transformers' GGUF
loader's logits; a Llama 3.x model written by qkv (rope_freqs) and read back with transformers' own logits of the
HF model; and files whose metadata contradicts itself, each refused in one line with exit code 2."""
import copy
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import qkv
from tests.formats.gguf import add_byte_level, gguf, llama_cpp, small_tokenizer, transformers
from tests.formats.hf import cli, perturbed

GEMMA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QWEN3 = {**{k: v for k, v in GEMMA.items() if "feedforward" not in k and "post_attention" not in k},
         "post_attention_layernorm": "ffn_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.3, 2.1, 3.7, 5.2],
            "short_factor": [1.0, 1.1, 1.05, 1.4], "original_max_position_embeddings": 16}


def llama_cpp_agrees(path, ids: torch.Tensor, gelu: bool = False) -> float:
    """llama.cpp reads the file as qkv does: logits within 1e-4 of the largest (F32 weights); where the model uses
    GELU, within 2e-3: ggml's tanh GELU reads an fp16 table (3.0e-4 to 3.2e-4 measured on these models). The relative
    difference, returned."""
    theirs = llama_cpp.logits(path, ids[0].tolist())
    with torch.no_grad():
        ours = qkv.load(path).model(ids)[0].double().numpy()
    relative = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert relative < (2e-3 if gelu else 1e-4), (path.name, relative)
    return relative


def gguf_name(hf_name: str, block: dict) -> str:
    if hf_name in TOP:
        return TOP[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{block['.'.join(rest[:-1])]}.{rest[-1]}"


def write(path, model, arch: str, block: dict, metadata: dict, shift: float = 0.0, drop=(), extra=None):
    """`model`'s weights (norms + `shift`, as llama.cpp stores Gemma's) under llama.cpp's names, a byte-level
    BPE, the architecture's metadata (`metadata`: {key without the arch prefix: value}; None drops a key)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, list):  # (one flag a layer: the newer converters' sliding_window_pattern)
            writer.add_array(f"{arch}.{key}", value)
        elif value is not None:
            kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
            writer.add_key_value(f"{arch}.{key}", value, kind)
    add_byte_level(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings or name in drop:
            continue
        w = tensor.detach().numpy().astype(np.float32) + (shift if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(gguf_name(name, block), w, raw_dtype=gguf.GGMLQuantizationType.F32)
    for name, w in (extra or {}).items():  # tensors that are settings (Phi-3's rope_factors_long / _short)
        writer.add_tensor(name, np.asarray(w, dtype=np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def qwen3():
    """head_dim 128 (not D / H = 8): transformers' GGUF loader keeps Qwen3's default of 128, llama.cpp reads
    attention.key_length; with 128 both are the same model."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(small_tokenizer()[0]), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True)
    model = perturbed(transformers.Qwen3ForCausalLM(config))
    meta = {"context_length": 128, "embedding_length": 32, "block_count": 2, "feed_forward_length": 48,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 128,
            "attention.value_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0}
    return model, meta


def gemma3(layers: int = 7):
    """head_dim 256: transformers' GGUF loader keeps Gemma 3's query_pre_attn_scalar of 256, llama.cpp scales by
    head_dim; with 256 both are the same model."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=len(small_tokenizer()[0]), hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=256, sliding_window=5, max_position_embeddings=128,
                                           query_pre_attn_scalar=256)
    model = perturbed(transformers.Gemma3ForCausalLM(config))
    meta = {"context_length": 128, "embedding_length": 32, "block_count": layers, "feed_forward_length": 48,
            "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 256,
            "attention.value_length": 256, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
            "attention.sliding_window": 5}
    return model, meta


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_logits_equal_transformers_gguf_loader(arch, tmp_path):
    model, meta = {"qwen3": qwen3, "gemma3": gemma3}[arch]()
    block, shift = (QWEN3, 0.0) if arch == "qwen3" else (GEMMA, 1.0)
    path = write(tmp_path / f"{arch}.gguf", model, arch, block, meta, shift)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 23))  # past the window of 5
    with torch.no_grad():
        expected, direct = theirs(ids).logits, model(ids).logits
        got = qkv.load(path).model(ids)
    assert (expected - direct).abs().max() < 1e-4  # the oracle reads the file as the model it came from
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    llama_cpp_agrees(path, ids, gelu=arch == "gemma3")


def test_llama3_scaling_written_as_rope_freqs_and_read_back(tmp_path):
    """transformers' GGUF loader drops rope_freqs, so the oracle is the HF model itself."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(small_tokenizer()[0]), hidden_size=128, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=256, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    tokens, merges, _ = small_tokenizer()
    run = qkv.load(tmp_path / "hf")
    assert run.config.model.rope_scaling == "llama3"
    from qkv.data.tokenizer import Tokenizer
    import dataclasses

    run = dataclasses.replace(run, tokenizer=Tokenizer.train(["To be, or not to be"] * 5, 300))
    path = qkv.formats.gguf.save(run, tmp_path / "llama3.gguf")
    assert "rope_freqs.weight" in gguf.GGUFReader(str(path)).fields or any(
        t.name == "rope_freqs.weight" for t in gguf.GGUFReader(str(path)).tensors)
    back = qkv.load(path)
    assert back.config.model.rope_scaling == "llama3" and back.config.model.rope_factor == 8.0
    ids = torch.randint(3, 250, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids), model(ids).logits, rtol=1e-4, atol=1e-4)
    llama_cpp_agrees(path, ids)  # (transformers' GGUF loader drops rope_freqs; llama.cpp reads it)


def test_gemma2_as_llama_cpp_lays_it_out(tmp_path):
    """Gemma 2: sandwich norms stored as 1 + w, no q/k norms, alternating window and global layers (llama.cpp's
    constant: the first slides), soft-capped scores and logits from the metadata. The HF model it was made from
    and llama.cpp both give qkv's logits."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=len(small_tokenizer()[0]), hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       sliding_window=5, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0, max_position_embeddings=128)
    model = perturbed(transformers.Gemma2ForCausalLM(config))
    block = {k: v for k, v in GEMMA.items() if "q_norm" not in k and "k_norm" not in k}
    meta = {"context_length": 128, "embedding_length": 32, "block_count": 4, "feed_forward_length": 48,
            "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 16,
            "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0,
            "attention.sliding_window": 5, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}
    path = write(tmp_path / "gemma2.gguf", model, "gemma2", block, meta, shift=1.0)
    run = qkv.load(path)
    assert run.config.model.layer_types == ("sliding", "global", "sliding", "global")
    ids = torch.randint(3, 250, (1, 23))  # past the window of 5
    with torch.no_grad():
        expected = model(ids).logits
        assert (run.model(ids) - expected).abs().max() < 1e-4 * expected.abs().max()
    llama_cpp_agrees(path, ids, gelu=True)


BAD = {  # metadata (or a tensor) that contradicts itself, and what the one line says
    "window of 0": ("gemma3", {"attention.sliding_window": 0}, (), "sliding_window=0: a window of no keys"),
    "heads do not divide": ("qwen3", {"attention.head_count_kv": 3}, (), "model.n_kv_heads=3 must divide"),
    "heads do not fit the tensor": ("qwen3", {"attention.head_count_kv": 1}, (), "k_proj.weight has shape (256, 32)"),
    "pattern of 0": ("gemma3", {"attention.sliding_window_pattern": 0}, (),
                     "sliding_window_pattern=0 must be a whole number of layers, at least 1"),
    "pattern longer than the layers": ("gemma3", {"attention.sliding_window_pattern": [True] * 9}, (),
                                       "sliding_window_pattern has 9 entries for 7 layers"),
    "unknown rope scaling": ("qwen3", {"rope.scaling.type": "ntk-by-parts"}, (), "rope.scaling.type='ntk-by-parts'"),
    "missing tensor": ("qwen3", {}, ("model.layers.1.self_attn.k_norm.weight",),
                        "no tensor 'model.layers.1.self_attn.k_norm.weight'"),
}


@pytest.mark.parametrize("case", BAD)
def test_contradictory_metadata_exits_2_in_one_line_and_writes_nothing(case, tmp_path):
    arch, change, drop, message = BAD[case]
    model, meta = {"qwen3": qwen3, "gemma3": gemma3}[arch]()
    strings = {k: v for k, v in change.items() if isinstance(v, str)}
    path = write(tmp_path / "bad.gguf", model, arch, QWEN3 if arch == "qwen3" else GEMMA,
                 {**meta, **{k: v for k, v in change.items() if not isinstance(v, str)}}, drop=drop,
                 ) if not strings else None
    if strings:  # a string value: written with its own type
        path = write_with_strings(tmp_path / "bad.gguf", model, arch, meta, strings)
    code, out, err = cli("convert", "--from-gguf", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("qkv: error:"), err
    assert message in err, err
    assert not (tmp_path / "run").exists()


def write_with_strings(path, model, arch, meta, strings):
    original = gguf.GGUFWriter.write_header_to_file

    def with_strings(self, *args, **kwargs):
        for key, value in strings.items():
            self.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.STRING)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "write_header_to_file", with_strings)
        return write(path, model, arch, QWEN3, meta)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_written_by_qkv_and_read_by_transformers_gguf_loader(arch, tmp_path):
    """qkv convert --to-gguf of an HF dir (f32): transformers' GGUF loader gives the HF model's logits, and qkv
    reads its own file back to the same; Gemma 3's SentencePiece tokenizer survives the round trip."""
    import dataclasses

    from qkv.data.tokenizer import Tokenizer
    from qkv.formats.gguf import save

    model, _ = {"qwen3": qwen3, "gemma3": gemma3}[arch]()
    model.save_pretrained(tmp_path / "hf")
    run = dataclasses.replace(qkv.load(tmp_path / "hf"), tokenizer=Tokenizer.train(["To be, or not to be"] * 5, 300))
    path = save(run, tmp_path / "out" / f"{arch}.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (1, 23))
    with torch.no_grad():
        expected = model(ids).logits
        assert (theirs(ids).logits - expected).abs().max() < 1e-4 * expected.abs().max()
        assert (qkv.load(path).model(ids) - expected).abs().max() < 1e-4 * expected.abs().max()
    llama_cpp_agrees(path, ids, gelu=arch == "gemma3")


def test_smollm3_and_phi3_as_llama_cpp_lays_them_out_give_the_hf_models_logits(tmp_path):
    """smollm3: LLaMA's names and Q/K rows permuted, every fourth layer without RoPE (llama.cpp's constant);
    phi3: fused attn_qkv and ffn_up (gate first), unpermuted; a partial rotation (Phi-4-mini's kind) as
    rope.dimension_count. The oracles: the HF model the file was made from, and llama.cpp."""
    from tests.formats.gguf import ggml_rows

    torch.manual_seed(0)
    small = dict(vocab_size=len(small_tokenizer()[0]), hidden_size=32, intermediate_size=48, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, rms_norm_eps=1e-5)
    models = {"smollm3": transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**small, num_hidden_layers=4)),
              "phi3": transformers.Phi3ForCausalLM(transformers.Phi3Config(**small, num_hidden_layers=2,
                                                                           tie_word_embeddings=False)),
              "phi3-partial": transformers.Phi3ForCausalLM(transformers.Phi3Config(  # 4 of 8 turned (rope.dimension_count)
                  **small, num_hidden_layers=2, tie_word_embeddings=False, partial_rotary_factor=0.5)),
              "phi3-longrope": transformers.Phi3ForCausalLM(transformers.Phi3Config(  # past 16 positions: the long set
                  **{**small, "max_position_embeddings": 64}, num_hidden_layers=2, tie_word_embeddings=False,
                  original_max_position_embeddings=16, rope_parameters=LONGROPE))}
    base = {"context_length": 128, "embedding_length": 32, "feed_forward_length": 48, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
            "rope.dimension_count": 8}
    phi3_block = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
                  "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    ids = torch.randint(3, 250, (1, 23))
    for arch, model in models.items():
        model = perturbed(model)
        stored = copy.deepcopy(model)
        if arch == "smollm3":  # llama.cpp's converter permutes LLaMA's Q and K rows
            with torch.no_grad():
                for layer in stored.model.layers:
                    for proj, heads in ((layer.self_attn.q_proj, 4), (layer.self_attn.k_proj, 2)):
                        proj.weight.copy_(torch.from_numpy(ggml_rows(proj.weight.numpy(), heads)))
        longrope = arch.endswith("longrope")
        meta = {**base, "block_count": len(model.model.layers), "rope.dimension_count": 4 if "partial" in arch else 8,
                **({"rope.scaling.original_context_length": 16, "context_length": 64,
                    "rope.scaling.attn_factor": math.sqrt(1 + math.log(4) / math.log(16))} if longrope else {})}
        path = write(tmp_path / f"{arch}.gguf", stored, arch.partition("-")[0], QWEN3 if arch == "smollm3" else
                     phi3_block, meta, extra={"rope_factors_long.weight": LONGROPE["long_factor"],
                                              "rope_factors_short.weight": LONGROPE["short_factor"]} if longrope else None)
        run = qkv.load(path)
        with torch.no_grad():
            expected = model(ids).logits
            assert (run.model(ids) - expected).abs().max() < 1e-4 * expected.abs().max(), arch
        llama_cpp_agrees(path, ids)
        if arch == "smollm3":
            assert run.config.model.layer_types == ("global", "global", "global", "nope")


def test_reading_a_gemma3_file_does_not_import_the_compiler(tmp_path):
    """qkv chat's first reply does not wait for torch._dynamo (2 s): the loader's trial of Gemma's (1 + w) norm
    mapping on shape-only tensors makes them without arithmetic, which on meta tensors imports it."""
    model, meta = gemma3()
    path = write(tmp_path / "gemma3.gguf", model, "gemma3", GEMMA, meta, 1.0)
    code = ("import sys; from qkv.generate import weights; run = weights.load(sys.argv[1]); "
            "weights.prepare(run.model); print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
