"""Write the transformers config.json of a llmtrain zoo model (run with llmtrain's Python).

    .venv/bin/python bench/peers/hf_config.py llama-debug /tmp/peers/llama-debug

The peers then build the same architecture from it with random weights, so every tool trains the
same model: same shapes, vocabulary, RoPE base, norms and activation.
"""

import json
import sys
from pathlib import Path

from llmtrain.config import Config
from llmtrain.convert.adapters import adapter_for_config

name, out_dir = sys.argv[1], Path(sys.argv[2])
config = Config.from_name(name)
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "config.json").write_text(json.dumps(adapter_for_config(config).hf_config(config), indent=2))
print(out_dir / "config.json")
