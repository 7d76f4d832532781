"""A sliding layer's keys in a ring (qkv.nn.cache) in the server's batch (qkv.serve.rows.gather_rows): rows
gathered from rings that wrapped round, cut back as rows leave, and every request's tokens still those
`generate` gives it alone."""
from qkv.serve.engine import Engine
from tests.serve.test_engine import GEMMA, Recorder, alone, check_batched_equals_alone, model_for, prompts


def test_sliding_layers_serve_from_rings_and_each_request_equals_generate_alone(monkeypatch):
    """The batch keeps a sliding layer's keys in a ring (qkv.nn.cache). Requests that join a row whose ring
    wrapped round long ago (gathered from it), and go on after it left (the columns cut back: keep_last), get
    the greedy tokens `generate` gives each alone (whose own cache is one of rings too); so do 16 joining by turns."""
    from qkv.nn.cache import LayerCache, RingLayerCache
    from qkv.serve import engine as engine_module

    gathered, turned = [], []
    gather, keep_last = engine_module.gather_rows, RingLayerCache.keep_last

    def recorded(model, parts, room):
        out = gather(model, parts, room)
        gathered.append((max(cache.length for cache, _, _ in parts), [type(layer) for layer in out.layers]))
        return out

    monkeypatch.setattr(engine_module, "gather_rows", recorded)
    monkeypatch.setattr(RingLayerCache, "keep_last", lambda self, n: turned.append(n) or keep_last(self, n))
    model = model_for(**GEMMA)
    engine = Engine(model, max_batch=4)
    first, later = Recorder(), [Recorder(), Recorder()]
    texts = prompts(3)
    jobs = [first.job(texts[0], 40)] + [r.job(p, n) for r, p, n in zip(later, texts[1:], (30, 20))]
    own = jobs[0].on_token

    def join_later(choice):  # the others arrive after the first row's ring wrapped round
        if len(first.tokens) == 25:
            engine.submit(*jobs[1:])
        return own(choice)

    jobs[0].on_token = join_later
    engine.start()
    try:
        engine.submit(jobs[0])
        for recorder in [first] + later:
            assert recorder.done.wait(60)
    finally:
        engine.stop()
    for recorder, prompt, n in zip([first] + later, texts, (40, 30, 20)):
        assert recorder.tokens == alone(model, prompt, n) and recorder.reason == "length"
    assert all(kinds == [RingLayerCache, LayerCache] for _, kinds in gathered)
    assert max(length for length, _ in gathered) > 4 + 16 and turned  # from a wrapped ring; cut back
    check_batched_equals_alone(model)
