"""Chat messages → the engine's PromptInputs: count images, fetch them, then the CPU work off the event loop."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

from api.config import DEFAULT_VIDEO_LIMIT
from api.errors import APIError
from api.media import MediaFetcher
from lm_engine.engine import LLMEngine
from lm_engine.processor import ChatInput, PromptInputs, normalize_messages


async def fetch_all(jobs: list[tuple]) -> list[bytes]:
    """``(fetch, url)`` pairs (a MediaFetcher's fetch or fetch_video) fetched concurrently; the first failure
    cancels the rest."""
    tasks = [asyncio.ensure_future(fetch(url)) for fetch, url in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def normalize(
    messages: list, max_images: int, tools: list[dict] | None = None, max_videos: int = DEFAULT_VIDEO_LIMIT
) -> ChatInput:
    """The messages (dicts, or the API's parsed ``Message``s) normalized (lm_engine.processor), refused if they
    carry more images or videos than allowed; ``tools``: what the prompt offers the model."""
    chat = normalize_messages([m.to_engine() if hasattr(m, "to_engine") else m for m in messages])
    chat.tools = tools
    if len(chat.images) > max_images:
        raise APIError(
            400,
            f"at most {max_images} image(s) per request are allowed (--limit-mm-per-prompt); got {len(chat.images)}",
            param="messages",
            code="too_many_images",
        )
    if len(chat.videos) > max_videos:
        raise APIError(
            400,
            f"at most {max_videos} video(s) per request are allowed (--limit-mm-per-prompt); got {len(chat.videos)}",
            param="messages",
            code="too_many_videos",
        )
    return chat


async def prepare_prompt(
    engine: LLMEngine,
    messages: list,
    media: MediaFetcher,
    *,
    max_images: int,
    max_videos: int = DEFAULT_VIDEO_LIMIT,
    executor: Executor | None = None,
    cache_salt: str = "",
    tools: list[dict] | None = None,
) -> PromptInputs:
    """OpenAI-style messages (image parts as ``{"type": "image_url", "image_url": {"url", "detail"}}``) → prompt.

    The image count is checked before anything is fetched. ``cache_salt``: the request's images are keyed under
    it (see LLMEngine.process_chat). Chat templating, tokenization and image
    processing run in ``executor``: they are CPU work that must not stall the event loop.
    """
    loop = asyncio.get_running_loop()
    # NOTE: on the executor too: a body of a million small messages takes seconds to walk, and on the event
    # loop those seconds would hold every other client and the balancer's health checks.
    chat = await loop.run_in_executor(executor, normalize, messages, max_images, tools, max_videos)
    parts = [(media.fetch, im) for im in chat.images]
    parts += [(media.fetch_video, v) for v in chat.videos if isinstance(v.source, str)]
    for (_, part), data in zip(parts, await fetch_all([(fetch, part.source) for fetch, part in parts])):
        part.source = data
    return await loop.run_in_executor(
        executor, functools.partial(engine.process_chat, cache_salt=cache_salt), chat
    )
