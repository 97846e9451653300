"""Shared checks and helpers: Session.forward_greedy against the argmax, our sessions against libllama, and the
small pieces the family tests (test_families, test_sliding_window, test_hybrid) all need."""
import numpy as np

from kvflash_ggml import _core


def assert_greedy_matches_argmax(model, cfg, prompt: np.ndarray, n_steps: int) -> _core.Session:
    """Two sessions fed their own greedy choices: one takes NumPy's argmax of the logits, the other
    forward_greedy (argmax in the graph). Every choice must agree. Returns the logits session."""
    a, b = _core.Session(model, cfg), _core.Session(model, cfg)
    tok_a, tok_b = int(a.forward(prompt, 0).argmax()), b.forward_greedy(prompt, 0)
    for _ in range(n_steps):
        assert tok_a == tok_b
        tok_a = int(a.forward(np.array([tok_a], np.int32), a.n_tokens).argmax())
        tok_b = b.forward_greedy(np.array([tok_b], np.int32), b.n_tokens)
    assert tok_a == tok_b
    return a


def greedy_against_libllama(session: _core.Session, ref, prompt: np.ndarray, n_decode: int):
    """The prompt, then n_decode greedy steps with our argmax fed to both our session and libllama
    (LlamaReference). Returns (ours, theirs, fed): logits [len(prompt) + n_decode, n_vocab] each, and the
    fed tokens."""
    ours = [session.forward(prompt, 0, all_logits=True)]
    theirs = [ref.decode(prompt.tolist(), all_logits=True)]
    fed = []
    for i in range(n_decode):
        tok = int(ours[-1][-1].argmax())
        fed.append(tok)
        ours.append(session.forward(np.array([tok], np.int32), len(prompt) + i)[None, :])
        theirs.append(ref.decode([tok])[None, :])
    return np.concatenate(ours), np.concatenate(theirs), fed


def cpu_model(path: str) -> _core.Model:
    """The model on the CPU, one thread (ours and libllama then run the same kernels in the same order)."""
    return _core.Model(path, backend="cpu", n_threads=1)


def random_tokens(n: int, seed: int = 1, n_vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def run_fed(sess: _core.Session, prompt: np.ndarray, fed: list[int]) -> np.ndarray:
    """Logits of every prompt position, then after each fed token (teacher-forced)."""
    rows = [sess.forward(prompt, sess.n_tokens, all_logits=True)]
    for t in fed:
        rows.append(sess.forward(np.array([t], np.int32), sess.n_tokens)[None, :])
    return np.concatenate(rows)
