"""`qkv serve`: an OpenAI-compatible HTTP server over a qkv run or a Hugging Face model dir (docs/serve.md).

engine: continuous batching of decoding jobs on one thread that owns the model.
api: the OpenAI request fields, their checks. chat: chat templates.
choices: one choice's text and logprobs as events, and the API's response shapes.
app: the Starlette application. server: loading the run, binding the socket, uvicorn until a signal.
"""
