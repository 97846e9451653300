"""The same prompt on a reference model (the local CPU) and on another placement of the same GGUF (an RPC device,
a split across devices): their full-cache logits (test_rpc, test_split)."""
import numpy as np

from kvflash_ggml import _core
from kvflash_ggml.testing.prose import prose_tokens


def prompt_logits_both(reference, other, vocab, seed: int, attention: str, what: str, n: int = 200):
    """All logits of an n-token prose prompt on both, and their max |difference| (printed, labelled `what`)."""
    tokens = prose_tokens(vocab, n, seed=seed)
    cfg = _core.SessionConfig(max_tokens=256, pool_tokens=0, attention=attention)
    a, b = (_core.Session(m, cfg).forward(tokens, 0, all_logits=True) for m in (reference, other))
    diff = float(np.abs(a - b).max())
    print(f"{what} vs cpu, {n}-token prompt, attention={attention}: max |logit diff| {diff}")
    return a, b, diff
