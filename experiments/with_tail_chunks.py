"""Runs a kvflash command with PoolConfig.tail_chunks set by $TAIL (research: Model and the CLI take no such keyword).

    TAIL=2 python experiments/with_tail_chunks.py bench ruler --model smollm2 --kvflash 512 --tasks multiquery ...

The protected tail window is the head chunk and tail_chunks before it (cpp/pager/kv_pager.h, I4): at a small pool it
leaves few chunks for evidence (docs/RESULTS.md, R130).
"""
import functools
import os
import sys

import kvflash_ggml.model as model_module
from kvflash_ggml import options
from kvflash_ggml.commands import main

model_module.PoolConfig = functools.partial(options.PoolConfig, tail_chunks=int(os.environ["TAIL"]))
sys.exit(main(sys.argv[1:]))
