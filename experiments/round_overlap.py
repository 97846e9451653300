"""What a scheduler round costs when the event loop has work per record (a server's SSE chunk: WORK us of Python
each), 8 slots of a tiny random model (tiny-llama) decoding together, the scheduler in-process (no HTTP): wall time
of the rounds that batched 6 or more tokens, min and median over 5 sends of 300 tokens. The scheduler wakes the loop
with a round's records right before its next step (server/scheduler.py, Outbox), so the loop's work runs while the
step holds no GIL; A/B against another checkout by running both.

    OMP_WAIT_POLICY=passive python experiments/round_overlap.py 100
"""
import asyncio
import json
import sys
import tempfile
import time

import numpy as np
from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig, ResidencyConfig, SamplingParams
from kvflash_ggml.server.scheduler import Request, Scheduler, slot_engines
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.tokenizer import Tokenizer

work_us = float(sys.argv[1]) if len(sys.argv) > 1 else 100.0
p = str(rg.write_preset(tempfile.mkdtemp() + "/ro.gguf", "tiny-llama"))
model = _core.Model(p, backend="cpu", n_threads=1)
tok = Tokenizer(p)
engines = slot_engines(8, model, tok, PoolConfig(n_ctx=4096, pool_tokens=512),
                       ResidencyConfig(policy="lru", prefill="exact"), store_each_turn=False)
sched = Scheduler(engines, max_queue=8, batch=True)
rounds = [0.0, 0]
orig_round = Scheduler._round


def timed_round(self):
    n0, t0 = self.n_batched_tokens, time.perf_counter()
    orig_round(self)
    if self.n_batched_tokens - n0 >= 6:
        rounds[0] += time.perf_counter() - t0
        rounds[1] += 1


Scheduler._round = timed_round
rng = np.random.default_rng(0)
prompts = [rng.integers(1, model.hparams.n_vocab, 700).tolist() for _ in range(8)]


def busy(us):
    t = time.perf_counter() + us * 1e-6
    d = {"choices": [{"delta": {"content": "x" * 8}}]}
    while time.perf_counter() < t:
        json.dumps(d)


async def send(n):
    loop = asyncio.get_running_loop()
    reqs = [Request(q, SamplingParams(max_tokens=n, temperature=0), loop) for q in prompts]
    for r in reqs:
        sched.submit(r)
    async def drain(r):
        while (await r.out.get()) is not None:
            busy(work_us)
    await asyncio.gather(*(drain(r) for r in reqs))


async def main():
    await send(1)
    res = []
    for _ in range(5):
        rounds[:] = [0.0, 0]
        await send(300)
        res.append(rounds[0] / rounds[1] * 1e6)
    res.sort()
    print(f"consumer work {work_us:g} us a record: a round of >= 6 tokens {res[0]:.0f} / {res[2]:.0f} us (min / median)")


asyncio.run(main())
sched.stop()
