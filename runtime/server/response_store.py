"""The Responses API's stored responses, as vLLM's OpenAI server keeps them: `ResponseStore`,
a bounded LRU in the HTTP server process's memory (never on disk, never shared between
processes, lost on restart).

A stored response is its final Response object (what GET /v1/responses/{id} returns) and the
conversation the model saw: the input items after resolving `previous_response_id` (the earlier
conversation's items first, then the request's own; `instructions` are not among them: OpenAI
carries no instructions over). A later request naming it continues from those items followed by
its output items. At most `capacity` responses are kept (MAX_STORED_RESPONSES by default); the
least recently stored or used one is evicted first, and an evicted id is as unknown as one never
stored. A conversation holds every earlier turn, so a long chain costs memory per stored turn.

Pure data: no client, no event loop, no requests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED_RESPONSES = 1000  # responses kept in memory by default (least recently used go)


@dataclass(frozen=True)
class Stored:
    """One stored response: its Response object and the input items the model saw."""

    response: dict
    input: list[dict]

    def conversation(self) -> list[dict]:
        """The items a request continuing from this one starts with: input, then output."""
        return [*self.input, *self.response.get("output", [])]


class ResponseStore:
    """Stored responses by id, at most `capacity`, the least recently used evicted first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def put(self, response: dict, input_items: list[dict]) -> None:
        """Keep `response` (its "id" names it) and its input items, evicting the oldest."""
        rid = response["id"]
        self._items[rid] = Stored(response, list(input_items))
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        """The stored response (now the most recently used), or None if unknown."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was unknown."""
        return self._items.pop(response_id, None) is not None
