"""Runs a kvflash command (a bench) with settings Model and the CLI do not take, each from the environment (research):

    TAIL=2 python experiments/with_knobs.py bench ruler --model smollm2 --kvflash 512 --tasks multiquery ...
    FFN_PART_ROWS=512 python experiments/with_knobs.py bench prefill --model l8b.gguf --lengths 32768 ...

TAIL: PoolConfig.tail_chunks. The protected tail window is the head chunk and tail_chunks before it
(cpp/pager/kv_pager.h, I4): at a small pool it leaves few chunks for evidence (docs/RESULTS.md, R130).
FFN_PART_ROWS: the exact prefill's ffn_part_rows (Session.begin_prefill_exact): the most rows of a step its
feed-forward takes at once (0: _core.EXACT_FFN_PART_ROWS, the default step's whole; 512: parts, as before R134).
"""
import functools
import os
import sys

import kvflash_ggml.model as model_module
from kvflash_ggml import _core, options
from kvflash_ggml.commands import main

if "TAIL" in os.environ:
    model_module.PoolConfig = functools.partial(options.PoolConfig, tail_chunks=int(os.environ["TAIL"]))
if "FFN_PART_ROWS" in os.environ:
    begin = _core.Session.begin_prefill_exact
    _core.Session.begin_prefill_exact = functools.partialmethod(begin, ffn_part_rows=int(os.environ["FFN_PART_ROWS"]))
sys.exit(main(sys.argv[1:]))
