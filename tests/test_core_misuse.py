"""The compiled core under misuse (issue 18): bad arguments raise Python exceptions naming the problem.

Runs in a child process, so a crash (an abort in ggml, a segfault) fails the test with the call that
caused it instead of killing pytest.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# (python expression, expected exception type name, a fragment of its message)
CASES = [
    # positions and slots are int32: a larger context once reached a 2^62-entry chunk table (MemoryError)
    ("S(max_tokens=2**62, allow_beyond_train_ctx=True)", "ValueError", "must be at most 2147483647 (got 4611686018427387904)"),
    ("S(sink_chunks=2**62)", "ValueError", "must be at most 2147483647"),
    ("c.testing.KvPager(c.PagerConfig(chunk_tokens=64, pool_tokens=448, max_tokens=2**62))", "ValueError",
     "exceeds the int32 position range"),
    ("c.testing.KvPager(c.PagerConfig(chunk_tokens=64, pool_tokens=448, max_tokens=4096, tail_chunks=2**62))", "ValueError",
     "must be at most 2147483647"),
    ("c.Model('/dev/null')", "RuntimeError", "is empty or not a regular file"),
    ("c.Vocab(DIR)", "RuntimeError", "is empty or not a regular file"),
    ("S().forward(np.array([], np.int32), 0)", "ValueError", "at least one token"),
    ("S().forward(np.array([10**6], np.int64), 0)", "ValueError", "outside the vocabulary"),
    ("S().truncate(-1)", "IndexError", "plan_truncate"),
    ("S().reselect(np.zeros((2, 2), np.float32))", "ValueError", "1-D"),
    ("S().kv.read_block(10**9)", "IndexError", "outside the pool"),
    ("c.testing.CpuPooledKV(n_layer=1, n_embd_k=64, n_embd_v=64, pool_tokens=448).kv.write_block(0, b'x')",
     "ValueError", "block image has 1 bytes"),
    ("S().kv.write_block(0, b'x')", "AttributeError", "write_block"),   # a session's pool is read-only
    ("S().pin(0, 10**6)", "IndexError", "0 <= lo <= hi <= max_tokens="),
    ("S().pager.slot_of(-1)", "IndexError", "outside [0, max_tokens"),
    ("S().adopt(S(), 10)", "ValueError", "cannot take positions"),
    ("c.Vocab(PATH).detokenize([10**6])", "ValueError", "outside the vocabulary"),
    # libllama asserts on these (GGML_ASSERT n_tokens_all <= n_batch, token ids): the reference checks first
    ("c.testing.LlamaReference(PATH, n_ctx=64).decode(list(range(1, 300)))", "ValueError", "exceed the reference's n_ctx="),
    ("c.testing.LlamaReference(PATH, n_ctx=64).decode([10**6])", "ValueError", "outside the vocabulary"),
]

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvflash_ggml import _core as c
    PATH, DIR = sys.argv[1], sys.argv[2]
    m = c.Model(PATH, backend="cpu", n_threads=1)
    def S(**kw):
        return c.Session(m, c.SessionConfig(**{"max_tokens": 256, "pool_tokens": 448, **kw}))
    out = []
    for expr in json.loads(sys.argv[3]):
        print(expr, flush=True)   # the last line names the call that crashed
        try:
            eval(expr)
            out.append(["returned", ""])
        except Exception as e:
            out.append([type(e).__name__, str(e)])
    print("RESULT " + json.dumps(out))
""")


def test_misuse_raises_python_exceptions(tiny_gguf, tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT, tiny_gguf(), str(tmp_path), json.dumps([c[0] for c in CASES])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit code {p.returncode} at {p.stdout.splitlines()[-1:]}:\n{p.stderr[-2000:]}"
    got = json.loads(p.stdout.rsplit("RESULT ", 1)[1])
    for (expr, kind, fragment), (got_kind, message) in zip(CASES, got):
        assert got_kind == kind and fragment in message, f"{expr}: {got_kind}: {message}"

