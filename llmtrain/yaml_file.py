"""Reading the YAML files that checkpoints carry (model_config.yaml, hyperparameters.yaml, prompt_style.yaml, lora.yaml).

``yaml.safe_load`` already refuses the tags that would construct Python objects (``!!python/object/apply:os.system``
never runs), but as a ``ConstructorError`` traceback that names no file; a file cut short or edited by hand gives a
``ParserError`` the same way. Here either becomes one line that names the file, which the CLI prints with exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``, read safely; a ``ValueError`` naming the file if it is not plain YAML."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}{at} is not a YAML file llmtrain can read: {problem}. Checkpoints hold plain YAML, "
                         "no tags and no Python objects: restore the file from the run that wrote it") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text: restore the file from the run that wrote it") from None
