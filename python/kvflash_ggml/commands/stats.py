"""`kvflash generate --stats`: a short summary a person reads (speeds, memory by kind, the pool and its paging),
and with --json the whole of stats() with the speeds, as one JSON object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .. import _core

MiB = 2 ** 20


@dataclass
class Timing:
    """One generation as the command saw it: seconds from the call to the first token (the prompt's
    computation and the first token's choice) and to the end, and the token counts of the closing usage."""
    t_first: Optional[float] = None
    t_total: float = 0.0
    n_prompt: int = 0
    n_generated: int = 0

    def prompt_rate(self) -> Optional[float]:
        return self.n_prompt / self.t_first if self.t_first else None

    def decode_rate(self) -> Optional[float]:
        """Tokens after the first over the time after it (the first token's time belongs to the prompt)."""
        t = self.t_total - (self.t_first or 0.0)
        return (self.n_generated - 1) / t if self.n_generated > 1 and t > 0 else None


def rate(tokens: int, seconds: Optional[float], per_s: Optional[float]) -> str:
    if seconds is None:
        return f"{tokens} tokens"
    return f"{tokens} tokens in {seconds:.2f} s" + (f" ({per_s:.1f} tok/s)" if per_s is not None else "")


def count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def is_full_cache(stats: dict) -> bool:
    return stats.get("mode") == "full"


def kv_line(stats: dict, pool_flag: Union[None, int, str]) -> str:
    if is_full_cache(stats):
        return f"full cache of {stats['n_ctx']} tokens (--kvflash off): {stats['tokens']} tokens held"
    held = -(-stats["tokens"] // _core.CHUNK_TOKENS)
    how = "--kvflash auto" if pool_flag == "auto" else f"--kvflash {pool_flag}"
    return (f"pool of {stats['pool_tokens']} tokens ({how}) for a context of {stats['n_ctx']}: {stats['tokens']} "
            f"tokens held in {count(held, 'chunk')}, {stats['resident_chunks']} resident; policy {stats['policy']}")


def memory_line(stats: dict) -> str:
    """Device bytes by kind (the CPU backend's 'device' is this host's memory), then the host KV store."""
    kinds = [("weights", "device_weight_bytes"), ("KV cache" if is_full_cache(stats) else "KV pool", "device_kv_bytes"),
             ("rings", "device_ring_bytes"), ("recurrent state", "device_recurrent_bytes"),
             ("compute", "device_compute_bytes"), ("prefill workspace", "device_prefill_peak_bytes"),
             ("second model", "device_drafter_bytes")]
    names = "+".join(d["name"] for d in stats.get("devices", [])) or "device"
    parts = ", ".join(f"{name} {mib(stats[key])}" for name, key in kinds if stats.get(key))
    line = f"{names}: {parts}; peak {mib(stats.get('device_peak_bytes', 0))}"
    if stats.get("device_driver_bytes") is not None:
        line += f" (the driver counts {mib(stats['device_driver_bytes'])})"
    line += f"; host KV store {mib(stats.get('host_kv_bytes', 0))}"
    if stats.get("host_kv_max_bytes"):   # what n_ctx can come to (host_store.py)
        line += f" (at most {mib(stats['host_kv_max_bytes'])} at n_ctx)"
    return line


def summary(stats: dict, timing: Timing, pool_flag: Union[None, int, str]) -> str:
    lines = [("prompt", rate(timing.n_prompt, timing.t_first, timing.prompt_rate())),
             ("generated", rate(timing.n_generated, None if timing.t_first is None else timing.t_total - timing.t_first,
                                timing.decode_rate())),
             ("KV", kv_line(stats, pool_flag))]
    if not is_full_cache(stats):
        lines.append(("paging", f"{count(stats['page_outs'], 'chunk')} paged out, {stats['page_ins']} paged in "
                                f"({mib(stats['bytes_moved'])} moved) in {count(stats['reselects'], 'reselect')}"))
    lines.append(("memory", memory_line(stats)))
    if stats.get("spec_drafted") is not None:
        lines.append(("speculation", f"{stats['spec_accepted']} of {stats['spec_drafted']} drafted tokens kept "
                                     f"in {stats.get('spec_steps', 0)} verify steps"))
    return "\n".join(f"{name:<11} {text}" for name, text in lines)


def json_stats(stats: dict, timing: Timing) -> dict:
    """stats() and the command's speeds. In full-cache mode there is no pool and no residency policy: their keys
    are None rather than the context's size and the default policy's name."""
    out = dict(stats)
    if is_full_cache(stats):
        out.update(pool_tokens=None, policy=None)
    prompt, decode = timing.prompt_rate(), timing.decode_rate()
    out.update(prompt_tokens=timing.n_prompt, completion_tokens=timing.n_generated,
               prompt_seconds=timing.t_first, total_seconds=timing.t_total,
               prompt_tokens_per_s=None if prompt is None else round(prompt, 2),
               decode_tokens_per_s=None if decode is None else round(decode, 2))
    return out
