"""Chat messages → the engine's PromptInputs: count images, fetch them, then the CPU work off the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from api.errors import APIError
from api.media import MediaFetcher
from lm_engine.engine import LLMEngine
from lm_engine.processor import PromptInputs


def image_parts(messages: list[dict]) -> list[dict]:
    return [
        part
        for msg in messages
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") == "image_url"
    ]


async def fetch_all(media: MediaFetcher, urls: list[str]) -> list[bytes]:
    """Fetch concurrently; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(media.fetch(u)) for u in urls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def prepare_prompt(
    engine: LLMEngine,
    messages: list[dict],
    media: MediaFetcher,
    *,
    max_images: int,
    executor: Executor | None = None,
) -> PromptInputs:
    """OpenAI-style messages (image parts as ``{"type": "image_url", "image_url": {"url", "detail"}}``) → prompt.

    The image count is checked before anything is fetched. Chat templating, tokenization and image
    processing run in ``executor``: they are CPU work that must not stall the event loop.
    """
    parts = image_parts(messages)
    if len(parts) > max_images:
        raise APIError(
            400,
            f"at most {max_images} image(s) per request are allowed (--limit-mm-per-prompt); got {len(parts)}",
            param="messages",
            code="too_many_images",
        )
    data = await fetch_all(media, [p["image_url"]["url"] for p in parts])
    fetched = iter(data)
    resolved = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(fetched), "detail": p["image_url"].get("detail")}
                if p.get("type") == "image_url"
                else p
                for p in content
            ]
        resolved.append({**msg, "content": content})
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, engine.process_chat, resolved)
