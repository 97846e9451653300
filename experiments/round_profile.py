"""Where a scheduler round's host time goes (the Python around the batched step): 8 slots of a tiny random model
(tiny-llama: its step costs little) decode together, the scheduler's thread under cProfile over both sends (the
prompts, then 300 tokens each); prints the functions by their own time. Issue 38's throughput bars: on the H200
the 8B round spent ~3 ms outside the C++ step (R107).

    OMP_WAIT_POLICY=passive python experiments/round_profile.py [lru|quest]
"""
import asyncio
import cProfile
import pstats
import sys
import tempfile
import time

import numpy as np
from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig, ResidencyConfig, SamplingParams
from kvflash_ggml.server.scheduler import Request, Scheduler, slot_engines
from kvflash_ggml.tokenizer import Tokenizer
from kvflash_ggml.testing import random_gguf as rg

policy = sys.argv[1] if len(sys.argv) > 1 else "lru"
p = str(rg.write_preset(tempfile.mkdtemp() + "/rp.gguf", "tiny-llama"))
model = _core.Model(p, backend="cpu", n_threads=2)
tok = Tokenizer(p)
prof = cProfile.Profile()
orig = Scheduler._loop
def loop(self):
    prof.enable()
    try:
        orig(self)
    finally:
        prof.disable()
Scheduler._loop = loop
pool = PoolConfig(n_ctx=2048, pool_tokens=512)
engines = slot_engines(8, model, tok, pool, ResidencyConfig(policy=policy, prefill="exact"), store_each_turn=False)
sched = Scheduler(engines, max_queue=8, batch=True)
rng = np.random.default_rng(0)
prompts = [rng.integers(1, model.hparams.n_vocab, 700).tolist() for _ in range(8)]
async def send(n):
    loop = asyncio.get_running_loop()
    reqs = [Request(q, SamplingParams(max_tokens=n, temperature=0), loop) for q in prompts]
    for r in reqs: sched.submit(r)
    async def drain(r):
        while (await r.out.get()) is not None: pass
    await asyncio.gather(*(drain(r) for r in reqs))
async def main():
    await send(1)
    t = time.perf_counter(); await send(300); print("second send s", time.perf_counter() - t)
asyncio.run(main())
sched.stop()
print("batched steps", sched.n_batched_steps)
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(25)
