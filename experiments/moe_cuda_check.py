"""MoE on CUDA: ours vs libllama (both CUDA) vs ours on the CPU, and how many routing decisions differ."""
import subprocess, sys, numpy as np
sys.path.insert(0, "tests")
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
import test_cuda as tc

for name, (shape, kw, tol) in tc.VARIANTS.items():
    if "moe" not in name:
        continue
    path = str(rg.write_preset(f"/tmp/{name}.gguf", shape, **kw))
    cpu = _core.Model(path, backend="cpu", n_threads=8)
    gpu = _core.Model(path, backend="cuda")
    prompt = tc.prompt_for(cpu.hparams.n_vocab)
    fed = tc.greedy_tokens(cpu, _core.SessionConfig(max_tokens=512, attention="matmul"), prompt)
    g, _ = tc.run_session(gpu, _core.SessionConfig(max_tokens=512), prompt, fed)
    c, _ = tc.run_session(cpu, _core.SessionConfig(max_tokens=512, attention="matmul"), prompt, fed)
    import pathlib, tempfile
    t = pathlib.Path(tempfile.mkdtemp())
    ref = tc.libllama_cuda(path, prompt, fed, t)
    rows = lambda a, b: np.abs(a - b).max(-1)
    print(name, "gpu-vs-libllama-gpu", rows(g, ref).max(), "gpu-vs-cpu", rows(g, c).max(),
          "rows > tol gpu-vs-cpu", int((rows(g, c) > tol).sum()), "of", len(g),
          "median row diff", float(np.median(rows(g, c))), "argmax eq", float((g.argmax(-1) == c.argmax(-1)).mean()))
