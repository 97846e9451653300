"""Test fixtures shipped with the package (tests and benchmarks both use them):

    random_gguf  GGUF files with random weights of every supported family and size
                 (`python -m kvflash_ggml.testing.random_gguf OUT.gguf --shape ...`); the writer and the public
                 face of gguf_shapes (families, named shapes, option checks), gguf_tokenizer (the toy BPE
                 tokenizer), gguf_tensors (every tensor of a family) and gguf_values (the tensors' random values)
    prose        deterministic English-like text for long prompts
"""
