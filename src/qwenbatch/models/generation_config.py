"""The sampling defaults a model's creator recommends, from its ``generation_config.json``, as vLLM reads them.

vLLM (``--generation-config auto``, its default) gives a request that leaves temperature, top_p, top_k, min_p,
repetition_penalty or max_tokens unset the value of the model's generation config: Qwen2.5-Instruct's 0.7 / 0.8
/ 20 / 1.05, Qwen3's 0.6 / 0.95 / 20. It takes only the values that differ from transformers' own defaults
(``GenerationConfig.to_diff_dict``: a ``top_k`` of 50 is dropped, not applied), and ``max_new_tokens`` as
``max_tokens``; ``do_sample`` is ignored. ``--generation-config vllm`` keeps OpenAI's defaults, a folder reads its
``generation_config.json`` instead of the model's, and ``--override-generation-config`` sets values over either.

The default length is also a limit (vLLM's "server-wide limit") where the operator chose it: ``max_new_tokens``
from a folder named by ``--generation-config`` or from ``--override-generation-config`` lowers every request's
``max_tokens`` to it; the model's own (``auto``) is only the length of requests that set none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qwenbatch.sampling_params import SamplingDefaults

FILE_NAME = "generation_config.json"
# The keys read, with transformers' GenerationConfig defaults (None: it has none), and their SamplingParams names.
HF_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}


def recommended_values(path: Path) -> dict[str, Any]:
    """The sampling values of the generation config at ``path`` that differ from transformers' defaults, by their
    SamplingParams names; ValueError if the file is not a JSON object."""
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {
        SAMPLING_NAMES.get(key, key): config[key]
        for key, hf_default in HF_DEFAULTS.items()
        if config.get(key) is not None and config[key] != hf_default
    }


def sampling_defaults(source: str, model_folder: Path | None, overrides: dict[str, Any]) -> SamplingDefaults:
    """The defaults of an engine: ``source`` "auto" reads ``model_folder``'s generation config (none for dummy
    weights, or a folder without one), "vllm" none, else the folder named; ``overrides`` (SamplingParams names,
    or ``max_new_tokens``) win over what was read; the default length is a limit too where it came from a folder
    named or from ``overrides``. ValueError naming the file or value at fault."""
    if source == "vllm":
        values: dict[str, Any] = {}
    elif source == "auto":
        path = model_folder / FILE_NAME if model_folder is not None else None
        values = recommended_values(path) if path is not None and path.is_file() else {}
    else:
        path = Path(source) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"--generation-config {source}: no {FILE_NAME} there (or pass auto or vllm)")
        values = recommended_values(path)
    values.update({SAMPLING_NAMES.get(key, key): value for key, value in overrides.items()})
    if source not in ("auto", "vllm") or "max_tokens" in overrides or "max_new_tokens" in overrides:
        values["max_tokens_limit"] = values.get("max_tokens")
    try:
        return SamplingDefaults(**values)
    except (TypeError, ValueError) as e:
        hint = " (--generation-config vllm ignores the model's)" if source == "auto" else ""
        raise ValueError(f"the default sampling values {values}: {e}{hint}") from e
