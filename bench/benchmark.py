#!/usr/bin/env python
"""Same as `llmtrain benchmark ...`: python bench/benchmark.py --model llama-debug --precision bf16-true"""

import sys

from llmtrain.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "benchmark", *sys.argv[1:]]
    main()
