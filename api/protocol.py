"""The OpenAI chat-completions wire format: what a request may carry, and what a response looks like."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lm_engine.sampling_params import MAX_INT, MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS

# NOTE: strict — "2" is not an integer and true is not a number, as in the OpenAI API; unknown fields
# are ignored, as vLLM does, so clients that send extra OpenAI options keep working.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _STRICT
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]


class VideoURL(BaseModel):
    """vLLM's video part, with the sampling a request may ask for (within the server's limits)."""

    model_config = _STRICT
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"
    fps: float | None = Field(None, gt=0, le=1000)
    max_frames: int | None = Field(None, ge=1, le=MAX_INT)
    max_pixels: int | None = Field(None, ge=1, le=MAX_INT)


class VideoPart(BaseModel):
    model_config = _STRICT
    type: Literal["video_url"]
    video_url: VideoURL | Annotated[str, Field(min_length=1)]


_Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation)."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    def to_engine(self) -> dict:
        """The message as the engine's chat processing takes it; image parts keep their URL and detail."""
        role = "system" if self.role == "developer" else self.role
        extra: dict = {}
        if self.tool_calls:
            extra["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        if not isinstance(self.content, list):
            return {
                "role": role,
                "content": self.content,
                **extra,
            }  # None stays None: only an assistant may omit it
        parts: list[dict] = []
        for part in self.content:
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, VideoPart):
                spec = part.video_url
                spec = {"url": spec} if isinstance(spec, str) else spec.model_dump(exclude_none=True)
                parts.append({"type": "video_url", "video_url": spec})
            else:
                spec = part.image_url
                url, detail = (spec, "auto") if isinstance(spec, str) else (spec.url, spec.detail)
                parts.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
        return {"role": role, "content": parts, **extra}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None  # optional, as in vLLM: the served model by default
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None,
        ge=-1,
        le=MAX_INT,
        description="vLLM extension: sample among the k likeliest; -1 or 0: off; past the vocabulary: all of it",
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)]
        | None
    ) = None
    # Each generated token's log-probability under the model (before penalties, bias and temperature).
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Structured output and tools; api/structured.py checks them part by part (a 400 names the part).
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # Options that decide what a completion must be and that vlmserve does not have; each is accepted at its
    # default (what SDKs and agent frameworks send when unset) and refused otherwise, since ignoring it would
    # answer something other than what was asked for (``unsupported``).
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    # vLLM extensions.
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="vLLM extension: requests share cached prompt blocks and image embeddings only with "
        "requests that send the same salt",
    )
    ignore_eos: bool = False
    return_token_ids: bool = Field(
        False, description="vLLM extension: add prompt_token_ids and per-choice token_ids to the response"
    )
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    # vLLM's structured output: {"json" | "regex" | "choice" | "grammar": …}, and its older guided_* fields.
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first option set to something vlmserve cannot do, or None."""
        checks = [
            (
                "top_logprobs",
                bool(self.top_logprobs) and not self.logprobs,
                "top_logprobs needs logprobs: true",
            ),
            (
                "functions",
                bool(self.functions) and self.function_call != "none",
                "the legacy functions field is not supported: send tools",
            ),
            (
                "function_call",
                self.function_call not in (None, "none", "auto"),
                "function calling is not supported",
            ),
            (
                "modalities",
                self.modalities is not None and self.modalities != ["text"],
                'only the "text" output modality is supported',
            ),
            ("audio", self.audio is not None, "audio output is not supported"),
            ("prediction", self.prediction is not None, "predicted outputs are not supported"),
        ]
        return next(((name, message) for name, bad, message in checks if bad), None)


class BodyErrors(ValueError):
    """Validation errors found piecewise (``parse_large_request``), with pydantic's ``errors()`` shape."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(errors[0].get("msg", "invalid request body") if errors else "invalid request body")
        self._errors = errors

    def errors(self) -> list[dict]:
        return self._errors


def parse_large_request(raw: bytes) -> ChatCompletionRequest:
    """``ChatCompletionRequest.model_validate_json(raw)`` in small pieces, for a worker thread: a large body
    validated in one call holds the interpreter for all of its seconds (measured: 6.5 s for 60 MiB of small
    messages), while the event loop waits for it; message by message, other threads run in between (the one long
    hold left is ``json.loads``, about a second for such a body). Same rules: strict, as one call applies them."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BodyErrors(
            [{"type": "json_invalid", "loc": (), "msg": "Invalid JSON", "ctx": {"error": str(exc)}}]
        ) from None
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if isinstance(messages, list):
        parsed = []
        for i, message in enumerate(messages):
            try:
                parsed.append(Message.model_validate(message))
            except ValidationError as exc:
                errors = [{**e, "loc": ("messages", i, *e["loc"])} for e in exc.errors()]
                raise BodyErrors(errors) from None
        obj["messages"] = parsed  # NOTE: instances pass the model's own check as they are
    return ChatCompletionRequest.model_validate(obj)


# ---------------------------------------------------------------- responses (also the OpenAPI schema)


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    image_tokens: int
    video_tokens: int = 0
    text_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    visual_tokens: list[int] = Field(
        description="vlmserve extension: visual tokens per image or video, in prompt order"
    )
    visual_levels: list[int] = Field(
        description="vlmserve extension: visual budget level per image or video (0 = full resolution; higher: "
        "fewer pixels, and for a video fewer frames)"
    )


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobItem(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobItem] | None
    refusal: list[TokenLogprobItem] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vlmserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
