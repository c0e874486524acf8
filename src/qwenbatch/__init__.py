"""qwenbatch: batch inference for the Qwen model family."""

from qwenbatch.inputs import TextPrompt, TokensPrompt
from qwenbatch.outputs import CompletionOutput, RequestOutput
from qwenbatch.sampling_params import SamplingParams, StructuredOutputs

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the engine: loaded on first use, so that the engine's pure-Python parts (the
    # scheduler, the block manager) and the CLI's --help import without them.
    if name == "LLM":
        from qwenbatch.llm import LLM

        return LLM
    raise AttributeError(f"module 'qwenbatch' has no attribute {name!r}")
