"""Per-request sampling settings, validated at construction (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Every generated token is checked against every stop string and stop id, so one request's thousands of
# them would slow every request sharing its steps. OpenAI allows 4 stop strings; we take up to these.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# vLLM's threshold: a smaller temperature (1e-300 is 0 in float32, a division by zero) means greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias
MAX_LOGIT_BIAS_TOKENS = 1024  # a bound so one request's dict cannot slow every step it shares


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams), exactly one of: a JSON schema (``json``,
    as a dict or its JSON text), any JSON object (``json_object``), a ``regex``, one of the strings in ``choice``,
    or a Lark ``grammar`` (llguidance's dialect). ``disable_any_whitespace``: JSON without optional whitespace (a
    model that likes newlines cannot pad its output). The engine masks every token the match would not allow, and
    ends the output when the match is complete (finish reason "stop")."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs must set exactly one of json, json_object, regex, choice or "
                f"grammar, got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("SamplingParams.structured_outputs json must be a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, list | tuple) else ()
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError("SamplingParams.structured_outputs choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", choice)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy decoding. Every invalid value raises ``ValueError``
    naming the parameter, so a bad request fails before it reaches the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned per generated token
    # vLLM's: per prompt token after the first, its logprob given those before it and the top logprobs there.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # what the output must match (a JSON schema, a regex, ...)
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to these tokens' logits before sampling
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:  # also rejects NaN and inf
            fail("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            fail("logprobs", "must be an integer in [0, 20] or None")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            fail("prompt_logprobs", "must be an integer in [0, 20] or None")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            limit = MAX_STOP_STRING_CHARS
            raise ValueError(f"SamplingParams.stop must hold non-empty strings of at most {limit} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"SamplingParams.stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            fail("structured_outputs", "must be a StructuredOutputs or None")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
                fail("logit_bias", f"must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to biases")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in bias):
                fail("logit_bias", "must map non-negative token ids")
            if any(not isinstance(b, int | float) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in bias.values()):
                fail("logit_bias", f"must hold biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids:
                fail("allowed_token_ids", "must be a non-empty list of token ids or None")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                fail("allowed_token_ids", "must hold non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when the sampler must look at the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# The sampling knobs a model's generation config may set (and max_tokens), as SamplingParams names them.
KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request takes for the sampling values it leaves unset: OpenAI's defaults, or those the model's
    creator recommends in its ``generation_config.json`` (vLLM's ``--generation-config auto``; see
    ``models/generation_config.py``). ``max_tokens`` None: no default length. ``max_tokens_limit``: the most a
    request given to ``params`` may ask for (vLLM's server-wide limit), None for no limit."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    max_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        self.params()  # a ValueError naming the first invalid value
        if self.max_tokens_limit is not None:
            SamplingParams(max_tokens=self.max_tokens_limit)

    def params(self, **values) -> SamplingParams:
        """SamplingParams of ``values``, the sampling knobs missing or None in them taken from these defaults, and
        ``max_tokens`` where it is missing (vLLM's ``get_default_sampling_params``: SamplingParams' own 16 if there
        is no default length). A None ``max_tokens`` stays None: the engine then takes the default length, or
        what the context has room for if that is less (``InputProcessor.make_request``). A ``max_tokens`` above
        ``max_tokens_limit`` is lowered to it, as vLLM's server does (not its offline ``LLM``, which takes a
        caller's SamplingParams as they are, as ``LLM`` here does)."""
        for name in KNOBS:
            if values.get(name) is None:
                values[name] = getattr(self, name)
        if "max_tokens" not in values and self.max_tokens is not None:
            values["max_tokens"] = self.max_tokens
        limit, asked = self.max_tokens_limit, values.get("max_tokens")
        if limit is not None and isinstance(asked, int) and asked > limit:
            values["max_tokens"] = limit
        return SamplingParams(**values)

    def changed(self) -> dict[str, float | int]:
        """The values that differ from OpenAI's defaults (for the log and GET /config)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
