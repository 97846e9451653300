"""Test fixtures shipped with the package (tests and benchmarks both use them):

    random_gguf  GGUF files with random weights of every supported family and size
                 (`python -m kvflash_ggml.testing.random_gguf OUT.gguf --shape ...`)
    prose        deterministic English-like text for long prompts
"""
