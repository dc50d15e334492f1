"""``speculum serve``: an OpenAI-compatible HTTP server over the reference scheduler.

The server is a thin shell (``docs/serving.md``): :mod:`.engine_loop` owns the scheduler state in
one thread and calls ``scheduler.step``; :mod:`.protocol` turns OpenAI request bodies into
checked engine requests and engine outputs into OpenAI responses; :mod:`.chat` renders chat
templates; :mod:`.metrics` holds the Prometheus series; :mod:`.app` is the ASGI application.
Nothing here reaches ``pipelines/`` or ``spec/``, and the scheduler stays usable without it.
"""
