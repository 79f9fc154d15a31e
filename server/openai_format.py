"""OpenAI response shapes for /v1/completions and /v1/chat/completions, streamed or whole.

A formatter holds the per-choice state streaming needs (first chunk seen, text
offsets) and turns SeqUpdates / ChoiceResults into OpenAI objects.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from server.detokenizer import TokenTexts
from server.errors import APIError
from server.streaming import ChoiceResult, SeqUpdate, TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens read from the prefix cache (of the choice that read most)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def check_not_aborted(finish_reason: str | None) -> None:
    """The engine ending a request on its own is an error for an OpenAI client, never a finish reason."""
    if finish_reason == "abort":
        raise APIError(503, "The engine aborted the request.", code="engine_aborted")


class OpenAIFormat(ABC):
    """Shared envelope: id, object, created, model; usage over all prompts."""
    object_whole = object_chunk = ""

    def __init__(self, rid: str, model: str, texts: TokenTexts, prompt_tokens: int, want_logprobs: bool):
        self.rid, self.model, self.texts = rid, model, texts
        self.prompt_tokens, self.want_logprobs = prompt_tokens, want_logprobs
        self.created = int(time.time())
        self.started: set[int] = set()

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, results: list[ChoiceResult]) -> dict:
        for result in results:
            check_not_aborted(result.finish_reason)
        body = self.envelope(self.object_whole, [self.whole_choice(r) for r in results])
        body["usage"] = usage(self.prompt_tokens, sum(r.completion_tokens for r in results),
                              max(r.cached_tokens for r in results))
        return body

    def chunk(self, update: SeqUpdate) -> dict | None:
        """The stream chunk for an update, or None when it adds nothing visible."""
        check_not_aborted(update.finish_reason)
        first = update.index not in self.started
        self.started.add(update.index)
        if not (first or update.text or update.finish_reason or (self.want_logprobs and update.logprobs)):
            return None
        return self.envelope(self.object_chunk, [self.chunk_choice(update, first)])

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage(self.prompt_tokens, completion_tokens, cached_tokens)
        return body

    @abstractmethod
    def whole_choice(self, result: ChoiceResult) -> dict:
        """One choice of a non-streaming response."""

    @abstractmethod
    def chunk_choice(self, update: SeqUpdate, first: bool) -> dict:
        """One choice of a streamed chunk."""


class CompletionFormat(OpenAIFormat):
    object_whole = object_chunk = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None = None, choices_per_prompt: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo_texts, self.choices_per_prompt = echo_texts, choices_per_prompt
        self.offsets: dict[int, int] = {}

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.choices_per_prompt] if self.echo_texts else ""

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        offset = self.offsets.get(index, len(self._echo(index)))
        tokens, offsets = [], []
        for entry in entries:
            text = self.texts.text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.texts.text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def whole_choice(self, result: ChoiceResult) -> dict:
        return {"index": result.index, "text": self._echo(result.index) + result.text,
                "logprobs": self._logprobs(result.index, result.logprobs), "finish_reason": result.finish_reason}

    def chunk_choice(self, update: SeqUpdate, first: bool) -> dict:
        text = (self._echo(update.index) if first else "") + update.text
        return {"index": update.index, "text": text, "logprobs": self._logprobs(update.index, update.logprobs),
                "finish_reason": update.finish_reason}


class ChatFormat(OpenAIFormat):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.texts.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        content = []
        for entry in entries:
            item = self._entry(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in entry.top]
            content.append(item)
        return {"content": content}

    def whole_choice(self, result: ChoiceResult) -> dict:
        return {"index": result.index, "message": {"role": "assistant", "content": result.text},
                "logprobs": self._logprobs(result.logprobs), "finish_reason": result.finish_reason}

    def chunk_choice(self, update: SeqUpdate, first: bool) -> dict:
        delta = {"role": "assistant", "content": update.text} if first else \
            ({"content": update.text} if update.text else {})
        return {"index": update.index, "delta": delta, "logprobs": self._logprobs(update.logprobs),
                "finish_reason": update.finish_reason}
