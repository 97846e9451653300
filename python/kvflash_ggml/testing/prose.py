"""Deterministic English-like text for long prompts (tests and benchmarks): varied sentences from
templates, so a prompt of thousands of tokens reads as prose without shipping or downloading a corpus."""
import random

NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Gustav", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
CITIES = ["Lisbon", "Kyoto", "Nairobi", "Oslo", "Lima", "Toronto", "Cairo", "Hanoi", "Dublin", "Perth", "Quito"]
TOPICS = ["river ecology", "medieval trade", "glass making", "bird migration", "tidal energy", "old maps",
          "bread baking", "volcanic soil", "folk music", "bridge design", "star charts", "honey bees"]
TEMPLATES = [
    "In {year}, {a} travelled from {c1} to {c2} to study {t}.",
    "{a} wrote a long letter to {b} about the {t} of {c1}.",
    "The museum in {c1} opened a new hall on {t}, and {a} gave the first lecture there.",
    "Every spring {a} and {b} walked along the harbour of {c2}, talking about {t}.",
    "A small book on {t} by {b} became popular in {c1} around {year}.",
    "{a} kept careful notes on {t}, filling {n} notebooks before moving to {c2}.",
    "When the rain came to {c1}, {b} stayed inside and read about {t}.",
    "The council of {c2} asked {a} for advice on {t} in {year}.",
]


def prose(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        a, b = rng.sample(NAMES, 2)
        c1, c2 = rng.sample(CITIES, 2)
        out.append(rng.choice(TEMPLATES).format(a=a, b=b, c1=c1, c2=c2, t=rng.choice(TOPICS),
                                                year=rng.randint(1850, 2020), n=rng.randint(2, 40)))
    return " ".join(out)


def prose_tokens(vocab, n: int, seed: int):
    """The first n tokens of prose(seed) as vocab tokenizes it (with its special tokens): an int32 array."""
    import numpy as np
    tokens = vocab.tokenize(prose(n // 3 + 40, seed=seed), add_special=True)[:n]
    if len(tokens) != n:
        raise ValueError(f"prose gave {len(tokens)} tokens, not {n}")
    return np.array(tokens, np.int32)
