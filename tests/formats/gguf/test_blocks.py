"""A GGUF file's quantized blocks run as shipped (qkv.formats.gguf.blocks, the int4 and int8g kinds of
qkv.nn.quant): each block type decodes to the values the gguf package dequantizes, and a model stored in each
gives the logits of the same file dequantized to fp32, prefill and decode, eager and compiled."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from qkv.formats.gguf import blocks
from qkv.generate import generate, weights
from qkv.nn import quant
from qkv.nn.decoding_linear import summed_grouped_product, summing
from qkv.nn.embedding import QuantEmbedding
from qkv.nn.quant import QuantLinear
from tests.formats.gguf import write_llama

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the gguf package dequantizes these but does not quantize them
SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where each super-block keeps its fp16 scales


def blocks_of(w: np.ndarray, type_name: str, seed: int = 0) -> np.ndarray:
    """(rows, K) float -> (rows, bytes) blocks of `type_name`: quantized by the gguf package, or, for the
    K-quants, random codes and 6- or 8-bit scales under fp16 super-block scales of the matrix's size."""
    kind = GGMLQuantizationType[type_name]
    if type_name not in K_TYPES:
        return quants.quantize(w, kind)
    rng = np.random.default_rng(seed)
    rows, k = w.shape
    size = blocks.BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    scale = float(np.abs(w).max()) / (63 * 31 if type_name != "Q6_K" else 127 * 32)
    for start in SCALE_BYTES[type_name]:
        d = (rng.uniform(0.5, 1.0, (rows, k // 256)) * scale).astype(np.float16)
        raw[..., start:start + 2] = d.view(np.uint8).reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", blocks.SHIPPED_TYPES)
def test_each_block_type_decodes_to_the_gguf_packages_values(type_name):
    w = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    raw = blocks_of(w, type_name)
    codes, scale, low = blocks.decode(raw, type_name)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(16, 512)
    got = blocks.dequantize(codes, scale, low)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert scale.shape[1] == 512 // (16 if type_name == "Q6_K" else 32)  # the groups of the type
    kind = blocks.kind_of(type_name)
    assert (codes.dtype, int(codes.min()) >= (0 if kind == "int4" else -128)) == (
        np.uint8 if kind == "int4" else np.int8, True)
    if kind == "int4":
        assert codes.max() <= 15


@pytest.fixture(scope="module", params=blocks.SHIPPED_TYPES)
def shipped(request, tmp_path_factory):
    """A llama (d 256: the K-quants' super-blocks) whose every matrix is of one block type and whose head is
    tied to its embedding, loaded as shipped and dequantized; the products in fp32 (the oracle's precision)."""
    type_name = request.param
    path = write_llama(tmp_path_factory.mktemp(type_name) / "m.gguf", width=256, ffn=512, tied=True, seed=4,
                       raw=lambda name, w: (blocks_of(w, type_name), GGMLQuantizationType[type_name]))
    run, whole = weights.load(path), weights.load(path, quant="none")
    for module in run.model.modules():
        if isinstance(module, QuantLinear):
            module.compute_dtype = None  # (bf16 where native otherwise: not what an fp32 oracle holds)
    description = weights.prepare(run.model)  # (the fused Q/K/V and gate/up layers take that precision)
    weights.prepare(whole.model)
    return type_name, run, whole, description


def test_every_matrix_holds_its_blocks_and_gives_the_dequantized_logits(shipped):
    type_name, run, whole, description = shipped
    kind, head = blocks.kind_of(type_name), run.model.lm_head
    assert {m.kind for m in run.model.blocks.modules() if isinstance(m, QuantLinear)} == {kind}
    # the head too (int8g where the int4 kernel cannot take its rows: a vocabulary not a multiple of 16)
    assert isinstance(head, QuantLinear) and head.kind == (kind if head.out_features % 16 == 0 else "int8g")
    assert head.origin == type_name
    assert description == (f"the file's quantized blocks as shipped (15 {type_name} linear layers; the head "
                           f"{type_name}), fp32 activations")
    assert not any(type(m) is torch.nn.Linear for m in run.model.modules())
    ids = torch.tensor([run.tokenizer.encode("To be, or not to be, that is the question")])
    with torch.no_grad():
        got, want = run.model(ids), whole.model(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_tied_embedding_looks_its_rows_up_in_the_heads_blocks(shipped):
    """No second, dequantized copy of a quantized table tied to the head: its rows, looked up in the head's
    blocks, are the table the gguf package dequantizes."""
    _, run, whole, _ = shipped
    table, want = run.model.tok_emb, whole.model.tok_emb.weight
    assert isinstance(table, QuantEmbedding) and table.blocks is run.model.lm_head
    assert not list(table.parameters()) and not list(table.buffers())
    ids = torch.tensor([[3, 0, 17], [want.shape[0] - 1, 5, 3]])
    assert (table(ids) - want[ids]).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q6_K"])
def test_an_untied_table_looks_its_rows_up_in_its_own_blocks(tmp_path, type_name):
    """A quantized table beside its own head (Llama 3.1 8B's Q4_K beside Q6_K): held as its blocks, not in fp32;
    its rows the gguf package's dequantized table, the model's logits the dequantized model's."""
    path = write_llama(tmp_path / "m.gguf", width=256, ffn=512, seed=5,
                       raw=lambda name, w: (blocks_of(w, type_name, seed=len(name)), GGMLQuantizationType[type_name]))
    run, whole = weights.load(path), weights.load(path, quant="none")
    for module in run.model.modules():
        if isinstance(module, QuantLinear):
            module.compute_dtype = None
    description = weights.prepare(run.model)
    weights.prepare(whole.model)
    table, want = run.model.tok_emb, whole.model.tok_emb.weight
    assert isinstance(table, QuantEmbedding) and table.blocks is not run.model.lm_head
    assert description.endswith(f"the head {type_name}, the embedding {type_name}), fp32 activations")
    assert (table(torch.arange(want.shape[0])) - want).abs().max() <= 1e-6 * want.abs().max()
    ids = torch.tensor([run.tokenizer.encode("To be, or not to be, that is the question")])
    with torch.no_grad():
        got, expected = run.model(ids), whole.model(ids)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_a_bf16_model_looks_up_bf16_rows_and_keeps_them_in_a_bf16_cache(tmp_path):
    path = write_llama(tmp_path / "m.gguf", width=64, tied=True, seed=2,
                       raw=lambda name, w: (quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
    run, whole = weights.load(path), weights.load(path, quant="none")
    weights.prepare(run.model, dtype="bf16")
    ids = torch.tensor([[1, 2, 40]])
    assert torch.equal(run.model.tok_emb(ids), whole.model.tok_emb.weight[ids].bfloat16())
    assert run.model.new_cache(1, 8).layers[0].k.dtype == torch.bfloat16


def test_decoding_as_shipped_gives_the_dequantized_tokens(shipped):
    _, run, whole, _ = shipped
    ids = run.tokenizer.encode("Whether 'tis nobler")
    torch.manual_seed(0)
    mine = generate(run.model, torch.tensor([ids]), max_new_tokens=8, strategy="greedy")
    theirs = generate(whole.model, torch.tensor([ids]), max_new_tokens=8, strategy="greedy")
    assert mine.tolist() == theirs.tolist()


def test_a_compiled_rows_sum_of_grouped_codes_is_the_dequantized_product(monkeypatch):
    """int8g's one row inside a compiled step (summing: qkv.nn.decoding_linear.summed_grouped_product) against
    the same codes dequantized, with and without minima, groups of 32 and 16."""
    traced = []

    def recorded(*args):
        traced.append(args[1].shape)
        return summed_grouped_product(*args)

    monkeypatch.setattr(quant, "summed_grouped_product", recorded)
    for type_name in ("Q5_1", "Q6_K"):
        w = np.random.default_rng(2).standard_normal((48, 256)).astype(np.float32)
        codes, scale, low = blocks.decode(blocks_of(w, type_name), type_name)
        layer = QuantLinear.from_codes(torch.from_numpy(codes), torch.from_numpy(scale),
                                       None if low is None else torch.from_numpy(low), torch.randn(48))
        layer.compute_dtype, layer.narrow = None, False  # (the rows in fp32 throughout: narrow, tests/nn/test_native.py)
        x = torch.randn(1, 1, 256)
        want = x @ torch.from_numpy(blocks.dequantize(codes, scale, low)).t() + layer.bias
        step = torch.compile(layer, dynamic=False)
        with torch.no_grad(), summing(True):
            got = step(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        rows = torch.randn(1, 3, 256)  # a short prompt's rows in a compiled graph: W dequantized in one kernel
        with torch.no_grad(), summing(True):
            got = step(rows)
        want = rows @ torch.from_numpy(blocks.dequantize(codes, scale, low)).t() + layer.bias
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert traced == [(8, 48, 32), (16, 48, 16)]  # each compiled layer's one row took the summed form


def test_a_compiled_row_where_int8_sums_are_slower_calls_the_grouped_operator(monkeypatch):
    """Where this machine's int8 sums lose to torch's int8 kernel (qkv.nn.forms; summing without int8), a compiled
    step's one bf16 row of int8g calls grouped_product as one operator (qkv::grouped_product), through the
    generated C++ as the step compiles it: the eager product exactly, never the sums."""
    calls = []
    monkeypatch.setattr(quant, "summed_grouped_product", lambda *args: calls.append("summed"))
    w = np.random.default_rng(3).standard_normal((48, 256)).astype(np.float32)
    codes, scale, low = blocks.decode(blocks_of(w, "Q5_1"), "Q5_1")
    layer = QuantLinear.from_codes(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low), None)
    layer.compute_dtype, layer.native = torch.bfloat16, False  # (torch's int8 kernel: not grouped.c's loops)
    layer.codes = layer.codes.contiguous()  # (its groups' planes, as that kernel takes them)
    x = torch.randn(1, 1, 256)
    step = torch.compile(layer, dynamic=False, options={"cpp_wrapper": True})
    with torch.no_grad(), summing(frozenset({torch.float32, torch.bfloat16})):
        got = step(x)
    with torch.no_grad():
        eager = layer(x)
    torch._dynamo.reset()
    assert calls == [] and torch.equal(got, eager)
    want = x.bfloat16().double() @ torch.from_numpy(blocks.dequantize(codes, scale, low)).double().t()
    assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()  # bf16 rows and group sums


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_steps_bf16_rows_take_each_groups_product_within_its_rounding(type_name, rows):
    """int8g with bf16 rows (a CPU with native bf16): each group's sum by torch's int8 kernel, rounded once to
    bf16, weighed in fp32 (qkv.nn.grouped.grouped_product); against the float64 product of the same codes, within
    one bf16 rounding of each group's sum; a tall matrix too (its groups accumulated one by one)."""
    for n in (48, 16384):
        w = np.random.default_rng(3).standard_normal((n, 256)).astype(np.float32)
        codes, scale, low = blocks.decode(blocks_of(w, type_name), type_name)
        layer = QuantLinear.from_codes(torch.from_numpy(codes), torch.from_numpy(scale),
                                       None if low is None else torch.from_numpy(low), None)
        layer.compute_dtype, layer.native = torch.bfloat16, False  # (torch's int8 kernel: not grouped.c's loops)
        layer.codes = layer.codes.contiguous()  # (its groups' planes, as that kernel takes them)
        x = torch.randn(1, rows, 256).to(torch.bfloat16)
        with torch.no_grad():
            got = layer(x.float()).double()
        q = torch.from_numpy(codes).double().view(n, scale.shape[1], -1)
        xs = x.double().view(rows, 1, q.shape[1], q.shape[2])
        group_sums = (q * xs).sum(-1) * torch.from_numpy(scale).double()  # (rows, n, G)
        want = group_sums.sum(-1) + (0 if low is None else xs[:, 0].sum(-1) @ torch.from_numpy(low).double().t())
        bound = 2 ** -8 * group_sums.abs().sum(-1) + 2 ** -8 * want.abs()  # (the output's own bf16 rounding)
        assert ((got[0] - want).abs() <= bound + 1e-6).all(), ((got[0] - want).abs() - bound).max()


def test_a_strided_input_converted_to_bf16_reaches_the_int4_kernel_contiguous():
    """A view's rows (Gemma 3's FFN output after the fused gate/up) converted to the bf16 the kernel takes keep
    the view's strides unless made contiguous: torch's int4 kernel refuses them."""
    w = np.random.default_rng(5).standard_normal((32, 256)).astype(np.float32)
    codes, scale, low = blocks.decode(blocks_of(w, "Q4_K"), "Q4_K")
    layer = QuantLinear.from_codes(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low), None,
                                   kind="int4")
    layer.compute_dtype, layer.native = torch.bfloat16, False  # (torch's int8 kernel: not grouped.c's loops)
    layer.codes = layer.codes.contiguous()  # (its groups' planes, as that kernel takes them)
    x = torch.randn(256, 5).t()[None]  # (1, 5, 256), not contiguous
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x.contiguous()))
