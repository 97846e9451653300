"""`kvflash serve`: an OpenAI-compatible server where every conversation gets a bounded pool.

    scheduler.py  slots (one Engine each, shared weights), the wait queue, the one thread that computes
    app.py        the HTTP endpoints (FastAPI), errors, API key, streaming (SSE)
    schemas.py    request bodies (pydantic)
    limits.py     what a request may cost before any work (body, text bytes, messages); tokenizing off the event loop
    metrics.py    /metrics (Prometheus) and the per-request log line
    (../fit.py    --kvflash auto: the pool per slot that the free device memory holds)
"""
