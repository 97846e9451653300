"""Fuzz of GGUF metadata (issue 18): no metadata makes the process abort.

Each case rewrites the key/value section of a small random-weight GGUF (tensor infos and data kept,
re-aligned): keys deleted, retyped (every scalar type, strings, arrays of every element type), set to
zero, negative, huge, NaN/inf values, arrays cut short, lengthened, emptied or given duplicate
entries, keys the loader reads only when present added. Every case goes to _core.Model (then a
session runs one token) and to _core.Vocab (then tokenize / detokenize / token_to_piece): each must
load or raise a Python exception (MemoryError excepted: a size read from the file must be refused
before it is allocated). The cases run in a child process under a memory limit (RLIMIT_AS), so an
abort (GGML_ASSERT, SIGFPE) fails the test with the child's output, naming the case, instead of
killing pytest. Seeds are fixed; KVFLASH_GGUF_FUZZ_CASES changes the count of the slow variant.
"""
from __future__ import annotations

import copy
import json
import math
import os
import resource
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

# ---- the GGUF container: header, key/values, tensor infos, aligned data --------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
SCALAR_TYPES = INT_TYPES + (F32, F64, BOOL, STR)


class _Reader:
    def __init__(self, b: bytes):
        self.b, self.o = b, 0

    def get(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.b, self.o)[0]
        self.o += struct.calcsize("<" + fmt)
        return v

    def string(self) -> bytes:
        n = self.get("Q")
        self.o += n
        return bytes(self.b[self.o - n:self.o])

    def value(self, t: int):
        if t == STR:
            return self.string()
        if t == ARR:
            et, n = self.get("I"), self.get("Q")
            return et, [self.value(et) for _ in range(n)]
        return self.get(_FMT[t])


def _encode(t: int, v) -> bytes:
    if t == STR:
        return struct.pack("<Q", len(v)) + v
    if t == ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(_encode(et, x) for x in items)
    return struct.pack("<" + _FMT[t], v)


def parse_gguf(data: bytes) -> dict:
    r = _Reader(data)
    if r.get("I") != 0x46554747:
        raise ValueError("not a GGUF file")
    version, n_tensors, n_kv = r.get("I"), r.get("Q"), r.get("Q")
    kvs = []
    for _ in range(n_kv):
        key, t = r.string(), r.get("I")
        kvs.append([key, t, r.value(t)])
    infos_at = r.o
    for _ in range(n_tensors):
        r.string()
        n_dims = r.get("I")
        r.o += 8 * n_dims + 4 + 8
    align = next((v for k, t, v in kvs if k == b"general.alignment" and t == U32), 32)
    data_at = -(-r.o // align) * align
    return dict(version=version, n_tensors=n_tensors, kvs=kvs, infos=bytes(data[infos_at:r.o]),
                data=bytes(data[data_at:]))


def build_gguf(g: dict) -> bytes:
    out = bytearray(struct.pack("<IIQQ", 0x46554747, g["version"], g["n_tensors"], len(g["kvs"])))
    for key, t, v in g["kvs"]:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", t) + _encode(t, v)
    out += g["infos"]
    # the data starts where a reader looks for it: general.alignment when it is a valid U32, else 32
    align = next((v for k, t, v in g["kvs"] if k == b"general.alignment" and t == U32), 32)
    align = align if 0 < align < 1 << 16 and align & (align - 1) == 0 else 32
    out += bytes(-len(out) % align)
    return bytes(out + g["data"])


def set_key(g: dict, key: str, t: int, v) -> dict:
    k = key.encode()
    for kv in g["kvs"]:
        if kv[0] == k:
            kv[1], kv[2] = t, v
            return g
    g["kvs"].append([k, t, v])
    return g


def del_key(g: dict, key: str) -> dict:
    g["kvs"] = [kv for kv in g["kvs"] if kv[0] != key.encode()]
    return g


def write_base(path: Path, arch: str = "llama") -> Path:
    """The smallest model the fuzz needs: 2 layers, 32-wide, 300 tokens (byte tokens + merges + specials)."""
    from kvflash_ggml.testing.random_gguf import write_random_gguf
    return write_random_gguf(path, arch, n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff=64,
                             n_vocab=300, n_ctx_train=256, weight_type="f16")


ARCHS = ("llama", "qwen2", "qwen3")

# ---- mutations ------------------------------------------------------------------------------------

INTS = [0, 1, 2, 3, -1, -2, 7, 8, 15, 16, 17, 31, 32, 33, 64, 127, 128, 255, 256, 299, 300, 301, 1000, 4096,
        65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, -(2**31), -(2**63)]
FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-30, 1e-6, 1e4, 1e30, 3.4e38, 1e300,
          -1e4]
STRINGS = [b"", b"llama", b"qwen2", b"qwen3", b"gpt2", b"bert", b"t5", b"rwkv", b"none", b"no_vocab", b"llama-bpe",
           b"qwen2", b"smollm", b"linear", b"llama3", b"yarn", b"<|im_end|>", b"\xff\xfe\x00", b"x" * 300]
# keys the loaders read only when present
EXTRA_KEYS = ["{a}.rope.scaling.type", "{a}.rope.scaling.factor", "{a}.attention.key_length",
              "{a}.attention.value_length", "{a}.rope.dimension_count", "general.alignment", "tokenizer.ggml.scores",
              "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id",
              "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_space_prefix",
              "tokenizer.ggml.token_type_count", "split.count", "general.architecture", "{a}.vocab_size"]


def _fit(t: int, v: int) -> int:
    """v wrapped into integer type t, as a C cast would store it."""
    bits = struct.calcsize(_FMT[t]) * 8
    v %= 1 << bits
    return v - (1 << bits) if t in (I8, I16, I32, I64) and v >= 1 << (bits - 1) else v


def scalar(rng, t: int):
    if t in INT_TYPES:
        return _fit(t, int(rng.choice(INTS)))
    if t == F32:
        with np.errstate(over="ignore"):   # 1e300 becomes inf, as a float32 field would hold it
            return float(np.float32(rng.choice(FLOATS)))
    if t == F64:
        return float(rng.choice(FLOATS))
    if t == BOOL:
        return bool(rng.integers(0, 2))
    return bytes(rng.choice(STRINGS))


def array(rng, et: int, n: int):
    return et, [scalar(rng, et) for _ in range(n)]


def mutate_array(rng, v):
    et, items = v
    items = list(items)
    op = rng.integers(0, 6)
    if op == 0 and items:                         # cut short
        items = items[:int(rng.integers(0, len(items)))]
    elif op == 1:                                 # lengthened with copies or fresh values
        items += [items[-1] if items and rng.random() < 0.5 else scalar(rng, et) for _ in range(rng.integers(1, 5))]
    elif op == 2 and len(items) > 1:              # a duplicate entry
        i, j = rng.integers(0, len(items), 2)
        items[int(i)] = items[int(j)]
    elif op == 3 and items:                       # one entry changed
        items[int(rng.integers(0, len(items)))] = scalar(rng, et)
    elif op == 4:                                 # emptied
        items = []
    else:                                         # another element type, same count
        et = int(rng.choice(SCALAR_TYPES))
        items = [scalar(rng, et) for _ in items]
    return et, items


def mutate_once(g: dict, rng, arch: str) -> str:
    keys = [k.decode() for k, _, _ in g["kvs"]]
    if rng.random() < 0.2:
        key = str(rng.choice(EXTRA_KEYS)).format(a=arch)
    else:
        key = str(rng.choice(keys))
    old = next((kv for kv in g["kvs"] if kv[0] == key.encode()), None)
    op = rng.integers(0, 10)
    if op == 0:
        del_key(g, key)
        return f"del {key}"
    if op in (1, 2) and old is not None and old[1] == ARR:
        set_key(g, key, ARR, mutate_array(rng, old[2]))
        return f"{key}: array mutated"
    if op in (3, 4) and old is not None and old[1] in INT_TYPES + (F32, F64):
        t = old[1] if rng.random() < 0.5 else int(rng.choice(INT_TYPES + (F32, F64)))
        v = scalar(rng, t)
        set_key(g, key, t, v)
        return f"{key} = {v!r} (type {t})"
    if op == 5:
        et = int(rng.choice(SCALAR_TYPES))
        v = array(rng, et, int(rng.choice([0, 1, 2, 3, 299, 300, 301])))
        set_key(g, key, ARR, v)
        return f"{key} = array of {len(v[1])} (type {et})"
    t = int(rng.choice(SCALAR_TYPES))
    v = scalar(rng, t)
    set_key(g, key, t, v)
    return f"{key} = {v!r:.60} (type {t})"


def mutant(base: dict, rng, arch: str) -> tuple[bytes, str]:
    g = copy.deepcopy(base)
    what = [mutate_once(g, rng, arch) for _ in range(int(rng.integers(1, 4)))]
    if rng.random() < 0.03:
        g["version"] = int(rng.choice([0, 1, 2, 4, 99, 2**31]))
        what.append(f"version {g['version']}")
    data = build_gguf(g)
    if rng.random() < 0.05:   # the container itself: a count or length overwritten, or the file cut short
        head = len(data) - len(g["data"])
        at = int(rng.integers(0, head))
        if rng.random() < 0.5:
            data = data[:at]
            what.append(f"truncated at {at}")
        else:
            v = int(rng.choice(INTS)) % 2**64
            data = data[:at] + v.to_bytes(8, "little") + data[at + 8:]
            what.append(f"bytes {at}..{at + 8} = {v}")
    return data, "; ".join(what)


# ---- the child: load every case, report outcomes ---------------------------------------------------

# Not refusals: a size taken from the file reached an allocation, or this harness is wrong.
HARNESS_ERRORS = (MemoryError, TypeError, AttributeError, NameError)


def exercise(path: str) -> dict:
    """Load `path` as a model and as a vocabulary and use both; returns the outcome of each."""
    from kvflash_ggml import _core
    out = {}
    try:
        m = _core.Model(path, backend="cpu", n_threads=1)
        s = _core.Session(m, _core.SessionConfig(max_tokens=min(64, m.hparams.n_ctx_train), n_batch=8,
                                                 allow_beyond_train_ctx=True))
        s.forward(np.array([m.hparams.n_vocab - 1], np.int32), 0)
        out["model"] = "loaded"
    except HARNESS_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - any Python exception is a refusal; only a crash is a failure
        out["model"] = f"{type(e).__name__}: {e}"
    try:
        v = _core.Vocab(path)
        n = v.n_vocab
        ids = v.tokenize("Hello world <|im_end|> \u00e9\n", add_special=True, parse_special=True)
        ids += v.tokenize("plain", add_special=False, parse_special=False)
        v.detokenize([i for i in ids if 0 <= i < n], remove_special=True, unparse_special=True)
        for t in {0, n - 1, v.bos, v.eos, v.eot}:
            if 0 <= t < n:
                v.token_to_piece(t, special=True)
                v.is_eog(t)
        v.pieces([0, n - 1])
        _ = v.chat_template, v.add_bos, v.meta("general.name")
        out["vocab"] = "loaded"
    except HARNESS_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001
        out["vocab"] = f"{type(e).__name__}: {e}"
    return out


def child(base_path: str, n_cases: int, seed: int, arch: str) -> None:
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        limit = 4 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # else: under AddressSanitizer (.ci/sanitized_tests.sh), whose shadow memory alone reserves terabytes of
    # address space; there ASAN_OPTIONS max_allocation_size_mb sets the same 4 GiB bound per allocation
    base = parse_gguf(Path(base_path).read_bytes())
    rng = np.random.default_rng(seed)
    counts = {"model": {"loaded": 0, "refused": 0}, "vocab": {"loaded": 0, "refused": 0}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.gguf")
        for i in range(n_cases):
            data, what = mutant(base, rng, arch)
            Path(path).write_bytes(data)
            print(f"case {i}: {what}", flush=True)   # the last line names the case that crashed
            for part, outcome in exercise(path).items():
                counts[part]["loaded" if outcome == "loaded" else "refused"] += 1
    print("RESULT " + json.dumps(counts), flush=True)


def run_child(tmp_path, n_cases: int, seed: int, arch: str, timeout: int) -> dict:
    base = write_base(tmp_path / f"base-{arch}.gguf", arch)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_gguf_fuzz as t; " \
           f"t.child({str(base)!r}, {n_cases}, {seed}, {arch!r})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    tail = "\n".join((p.stdout + p.stderr).splitlines()[-15:])
    assert p.returncode == 0, f"the fuzz child died with exit code {p.returncode}:\n{tail}"
    result = json.loads(p.stdout.rsplit("RESULT ", 1)[1])
    print(f"\ngguf fuzz ({arch}, {n_cases} cases): {result}")
    return result


def test_fuzzed_gguf_metadata_loads_or_raises(tmp_path):
    result = run_child(tmp_path, n_cases=1500, seed=18, arch="llama", timeout=300)
    for part in ("model", "vocab"):   # the mutations reach both outcomes, for both loaders
        assert result[part]["loaded"] > 50 and result[part]["refused"] > 300, result


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fuzzed_gguf_metadata_long(tmp_path, arch):
    n = int(os.environ.get("KVFLASH_GGUF_FUZZ_CASES", "3000"))
    result = run_child(tmp_path, n_cases=n, seed=1800 + ARCHS.index(arch), arch=arch, timeout=1800)
    assert result["model"]["refused"] > 0 and result["vocab"]["refused"] > 0


# ---- the reported cases, one by one, with the reason each is refused for ----------------------------

CASES = {   # name -> (mutation, loader, expected message)
    "head_count 0": (lambda g: set_key(g, "llama.attention.head_count", U32, 0), "Model",
                     r"llama.attention.head_count = 0 is out of range"),
    "architecture u32": (lambda g: set_key(g, "general.architecture", U32, 5), "Model",
                         r"general.architecture holds u32, expected a string"),
    "name u32": (lambda g: set_key(g, "general.name", U32, 5), "Model", r"general.name holds u32, expected a string"),
    "scaling type u32": (lambda g: set_key(g, "llama.rope.scaling.type", U32, 5), "Model",
                         r"llama.rope.scaling.type holds u32, expected a string"),
    "freq_base nan": (lambda g: set_key(g, "llama.rope.freq_base", F32, math.nan), "Model",
                      r"llama.rope.freq_base = nan is not a finite float32"),
    "freq_base 0": (lambda g: set_key(g, "llama.rope.freq_base", F32, 0.0), "Model",
                    r"llama.rope.freq_base=0.0+ must be >= 1"),
    "scaling factor -inf": (lambda g: set_key(g, "llama.rope.scaling.factor", F32, -math.inf), "Model",
                            r"llama.rope.scaling.factor = -inf is not a finite float32"),
    "scaling factor 0": (lambda g: set_key(g, "llama.rope.scaling.factor", F32, 0.0), "Model",
                         r"llama.rope.scaling.factor=0.0+ must be > 0"),
    "version 99": (lambda g: g.update(version=99) or g, "Model",
                   r"is GGUF version 99, which is not supported \(this build reads versions 2-3\)"),
    "version 99 (vocab)": (lambda g: g.update(version=99) or g, "Vocab",
                           r"is GGUF version 99, which is not supported"),
    "duplicate token": (lambda g: set_key(g, "tokenizer.ggml.tokens", ARR, (STR, [b"a", b"a"] + [b"t%d" % i for i in
                                                                                          range(298)])), "Vocab",
                        r"token 1 \('a'\) appears twice"),
    "tokenizer none": (lambda g: set_key(g, "tokenizer.ggml.model", STR, b"none"), "Vocab",
                       r"tokenizer.ggml.model 'none' is not supported"),
    "no bos": (lambda g: set_key(g, "tokenizer.ggml.tokens", ARR, (STR, [b"a", b"b"])), "Vocab",
               r"add_bos_token is set but the vocabulary has no BOS token"),
    "pre-tokenizer unknown": (lambda g: set_key(g, "tokenizer.ggml.pre", STR, b"nonsense"), "Vocab",
                              r"could not load the vocabulary .*unknown pre-tokenizer type: 'nonsense'"),
}


def test_reported_metadata_cases_raise_with_the_reason(tmp_path):
    """Each crashed the process (SIGFPE, SIGABRT) or loaded silently (a NaN RoPE base) before issue 18."""
    base = parse_gguf(write_base(tmp_path / "base.gguf").read_bytes())
    files = {}
    for name, (mutation, loader, _) in CASES.items():
        files[name] = str(tmp_path / f"{len(files)}.gguf")
        Path(files[name]).write_bytes(build_gguf(mutation(copy.deepcopy(base))))
    script = textwrap.dedent(f"""
        import json
        from kvflash_ggml import _core
        out = {{}}
        for name, (path, loader) in json.loads({json.dumps(json.dumps({n: (files[n], CASES[n][1]) for n in CASES}))}).items():
            print(name, flush=True)
            try:
                getattr(_core, loader)(path)
                out[name] = "loaded"
            except Exception as e:
                out[name] = f"{{type(e).__name__}}: {{e}}"
        print("RESULT " + json.dumps(out))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit code {p.returncode} at case {p.stdout.splitlines()[-1:]}:\n{p.stderr[-2000:]}"
    got = json.loads(p.stdout.rsplit("RESULT ", 1)[1])
    import re
    for name, (_, _, pattern) in CASES.items():
        assert re.search(pattern, got[name]), f"{name}: {got[name]}"
