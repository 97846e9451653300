"""Does greedy speculative decoding return plain greedy decoding's text on a backend? (issue 39 item 5)

For each prompt, plain greedy decoding and greedy speculation with each drafter (prompt lookup, the model drafting
itself) generate --tokens tokens through the public API on the same backend and attention path; prints, per
drafter, how many prompts came out identical and where the others first diverged. Prompts: random token ids with
a repeated stretch (so that prompt lookup proposes), or the lines of --prompts-file as text.

    python experiments/spec_equality.py --model smollm2 --backend cpu --prompts 12 --tokens 48
    python experiments/spec_equality.py --model /tmp/l1b.gguf --backend cuda --attention flash
"""
import argparse
import json

import numpy as np

import kvflash_ggml as kvf


def random_prompts(n_vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        head = rng.integers(10, n_vocab, length // 2).tolist()
        out.append(head + head[: length // 2])   # a repeat: prompt lookup has something to copy
    return out


def generate(llm: kvf.Model, prompt, n_tokens: int) -> str:
    out = llm.create_completion(prompt, max_tokens=n_tokens, temperature=0.0)
    return out["choices"][0]["text"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompts-file", default=None, help="one text prompt a line (instead of random ids)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--drafters", default="prompt_lookup,self")
    ap.add_argument("--pool", default="none", help="pool_tokens (none: the full cache)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pool = None if args.pool == "none" else int(args.pool)
    common = dict(backend=args.backend, attention=args.attention, n_threads=args.threads, n_ctx=4096,
                  pool_tokens=pool)
    plain = kvf.Model(args.model, **common)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()][: args.prompts]
    else:
        prompts = random_prompts(plain._core_model.hparams.n_vocab, args.prompts, args.prompt_tokens, seed=0)
    reference = [generate(plain, p, args.tokens) for p in prompts]
    plain.close()
    rows = []
    for drafter in args.drafters.split(","):
        spec = kvf.Model(args.model, speculative=args.model if drafter == "self" else drafter, **common)
        texts = [generate(spec, p, args.tokens) for p in prompts]
        st = spec.stats()
        spec.close()
        diverged = [next(i for i, (a, b) in enumerate(zip(r + "\0", t + "\1")) if a != b)
                    for r, t in zip(reference, texts) if r != t]
        rows.append(dict(drafter=drafter, prompts=len(prompts), equal=len(prompts) - len(diverged),
                         first_divergence_chars=diverged, acceptance=st.get("spec_acceptance")))
        print(f"{args.backend} attention={args.attention} drafter={drafter}: {rows[-1]['equal']}/{len(prompts)} "
              f"prompts equal to plain greedy over {args.tokens} tokens; diverged at chars {diverged}; "
              f"acceptance {rows[-1]['acceptance']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
