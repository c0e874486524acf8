"""qwenbatch: batch inference for the Qwen model family."""

from qwenbatch.llm import LLM
from qwenbatch.outputs import CompletionOutput, RequestOutput
from qwenbatch.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
