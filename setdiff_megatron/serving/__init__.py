"""`setdiff serve`: an OpenAI-compatible server over the continuous-batching set sampler.

  protocol.py  the request bodies (OpenAI's fields plus set diffusion's knobs) and error objects
  replicas.py  the engines: a thread of this process, or torchrun worker groups (DP x TP)
  app.py       the FastAPI front end: completions, chat, streaming, models, health, metrics
  cli.py       the command
"""
