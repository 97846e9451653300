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


def session_of(model: _core.Model, max_tokens: int, pool: int = 0, **kw) -> _core.Session:
    """A session on the mul_mat path unless told otherwise (pool 0: full cache)."""
    kw.setdefault("attention", "matmul")
    return _core.Session(model, _core.SessionConfig(max_tokens=max_tokens, pool_tokens=pool, **kw))


def full_cache_against_libllama(path: str, attention: str, max_tokens: int, n_prompt: int, n_decode: int):
    """Our full cache and libllama on the same random prompt, then n_decode greedy steps (our argmax fed to both):
    (ours, theirs, fed) as greedy_against_libllama returns them."""
    ref = _core.testing.LlamaReference(path, n_ctx=max_tokens, n_threads=1, flash_attn=attention == "flash")
    return greedy_against_libllama(session_of(cpu_model(path), max_tokens, 0, attention=attention), ref,
                                   random_tokens(n_prompt), n_decode)


def preset_paths(tmp_path_factory, preset: str, variants: dict):
    """A module fixture's body: variant (default: the first) -> the path of `preset` written with that variant's
    overrides, each once."""
    from kvflash_ggml.testing import random_gguf as rg

    root = tmp_path_factory.mktemp(preset)
    paths: dict[str, str] = {}

    def get(variant: str = next(iter(variants))) -> str:
        if variant not in paths:
            paths[variant] = str(rg.write_preset(root / f"{variant}.gguf", preset, **variants[variant]))
        return paths[variant]

    return get


def assert_full_cache_matches_libllama(path: str, attention: str, max_tokens: int, n_prompt: int, n_decode: int,
                                       tol: float) -> None:
    """Our full cache against libllama (full_cache_against_libllama): every logit within tol, the same greedy
    tokens, and logits that are not trivially equal (finite, spread)."""
    ours, ref, _ = full_cache_against_libllama(path, attention, max_tokens, n_prompt, n_decode)
    assert np.isfinite(ours).all() and ours.std() > 0.01
    diff = float(np.abs(ours - ref).max())
    assert diff <= tol, f"max |logit diff| {diff:.3g}"
    np.testing.assert_array_equal(ours[n_prompt - 1:].argmax(-1), ref[n_prompt - 1:].argmax(-1))


def generate_with_live_eviction(path: str, policy: str, n_ctx: int, pool_tokens: int, **kw) -> dict:
    """An Engine on the CPU generating 40 sampled tokens after a 900-token prompt its pool cannot hold (the drafter
    policy drafting with the model itself); the stats() after it, checked for the 40 tokens and for page-outs."""
    from kvflash_ggml import Model

    with Model(model_path=path, n_ctx=n_ctx, pool_tokens=pool_tokens, backend="cpu", n_threads=1, policy=policy,
               tau=16, drafter_model=path if policy == "drafter" else None, **kw) as llm:
        # sampled from nearly flat logits (a random model's greedy loop soon reaches an end token); the seed is one
        # whose 40 tokens reach none on every family here (an end token stops a sample early)
        out = llm.create_completion(random_tokens(900).tolist(), max_tokens=40, temperature=1.0, seed=5)
        st = llm.stats()
    assert out["usage"]["completion_tokens"] == 40 and st["page_outs"] > 0
    return st
