"""qkv.serve.app against the real `openai` client and raw HTTP on 127.0.0.1: the routes (models, health, the
page), OpenAI's error body and statuses for every kind of bad request, the API key, and embeddings equal to
what the encoder's classifier pools."""
import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

import qkv
from tests.serve.live import Live, write_run


def test_models_health_and_the_page(live):
    client = live.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(live.url + "/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "qkv playground" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: works offline


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, None),  # not JSON: refused as the body
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "cat " * 80}, "prompt"),  # longer than the context of 64 tokens
    ({"prompt": "x", "max_tokens": 63}, "max_tokens"),  # prompt + new > context
    ({"prompt": [5, 999999]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "surprise": 1}, "surprise"),
    ({"prompt": "x", "temperature": 0, "top_p": 0.5}, "top_p"),  # no effect under greedy: refused
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_fields_get_400_with_the_param_named(live, body, param):
    raw = json.dumps({"model": "tiny", **body}).replace("NaN", "NaN")
    response = httpx.post(live.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    err = error_of(response)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_malformed_and_oversized_bodies_unknown_models_and_paths(live):
    bad = httpx.post(live.url + "/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and error_of(bad)["code"] == "invalid_json"
    assert httpx.post(live.url + "/v1/completions", json=[1, 2]).status_code == 400
    deep = httpx.post(live.url + "/v1/completions", content=b"[" * 100000 + b"]" * 100000)
    assert deep.status_code in (400, 413)
    huge = httpx.post(live.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (5 * 2 ** 20) + b'"}')
    assert huge.status_code == 413 and error_of(huge)["code"] == "request_too_large"
    with pytest.raises(openai.NotFoundError) as exc:
        live.client().completions.create(model="gpt-4", prompt="x")
    assert exc.value.status_code == 404 and exc.value.body["code"] == "model_not_found"
    assert httpx.get(live.url + "/v1/nothing").status_code == 404
    assert httpx.get(live.url + "/v1/completions").status_code == 405
    with pytest.raises(openai.BadRequestError):  # a decoder has no embeddings
        live.client().embeddings.create(model="tiny", input="x")
    # the server still answers correctly after every refusal
    assert live.client().completions.create(model="tiny", prompt="the", max_tokens=2).choices[0].text is not None


def test_an_api_key_is_required_when_set(run_dir):
    with Live(run_dir, api_key="s3cret") as server:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        missing = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        ok = server.client(api_key="s3cret").completions.create(model="tiny", prompt="x", max_tokens=1)
        assert ok.usage.completion_tokens == 1


def test_embeddings_of_an_encoder_are_what_its_classifier_pools(tmp_path):
    path = write_run(tmp_path / "enc", arch="encoder", head="classifier", n_classes=3, pooling="mean",
                     positional="learned")
    run = qkv.load(path)
    with Live(path) as server:
        client = server.client()
        texts = ["the cat sat", "where is the dog?"]
        result = client.embeddings.create(model="enc", input=texts, encoding_format="float")
        raw = httpx.post(server.url + "/v1/embeddings",
                         json={"model": "enc", "input": texts, "encoding_format": "base64"}).json()
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="enc", prompt="x")
        with pytest.raises(openai.BadRequestError) as exc:  # qkv does not truncate embeddings
            client.embeddings.create(model="enc", input="x", dimensions=8)
        assert exc.value.body["param"] == "dimensions"
        assert len(client.embeddings.create(model="enc", input="x", dimensions=32).data[0].embedding) == 32
    head = run.model.head
    for item, packed, text in zip(result.data, raw["data"], texts):
        ids = torch.tensor([run.tokenizer.encode(text)])
        vector = torch.tensor(item.embedding)
        with torch.no_grad():  # the classifier's own logits, from the embedding through its pooler and output
            logits = head.out_proj(torch.tanh(head.pooler(vector)))
            assert torch.allclose(logits, run.model(ids)[0], atol=1e-5)
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, vector.numpy().astype(np.float32))
    assert len(result.data[0].embedding) == 32 and result.usage.prompt_tokens > 0
