"""`setdiff serve`: an OpenAI-compatible server over the continuous-batching set sampler.

protocol.py  the request bodies (OpenAI's fields plus set diffusion's knobs)
responses.py the response and error objects, of the openai package's own types
metrics.py   what the front end counts, served to Prometheus
replicas.py  the engines: a thread of this process, or torchrun worker groups (DP x TP)
app.py       the FastAPI front end: completions, chat, streaming, models, health, metrics
serve_cli.py the command
"""
