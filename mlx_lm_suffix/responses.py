"""Which finished responses the global cache keeps: bounded in count and
tokens, evicted fairly across scopes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Tuple


class ResponseStore:
    """The finished responses kept in the drafter's global trees, oldest
    first, at most ``max_requests`` of them and ``max_tokens`` tokens in all.

    Past either bound, the scope holding the most (tokens for the token
    bound, responses for the count bound; ties: the one whose oldest
    response is oldest) loses its oldest response, so one scope's traffic
    evicts another's only while that one holds more. A response longer than
    ``max_tokens`` is not kept (it would evict every scope's)."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tokens = 0
        # req_id -> (scope, tokens), oldest first (req ids grow with time);
        # per scope, its own (req_id -> token count) and total.
        self._all: "OrderedDict[int, Tuple[Hashable, List[int]]]" = OrderedDict()
        self._own: "Dict[Hashable, OrderedDict[int, int]]" = {}
        self._held: Dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._all)

    def responses(self) -> List[Tuple[Hashable, List[int]]]:
        """The kept ``(scope, tokens)`` pairs, oldest first (the lists are the
        store's own: read them, do not change them)."""
        return list(self._all.values())

    def add(self, req_id: int, scope: Hashable, tokens: List[int]) -> List[Tuple[Hashable, int]]:
        """Keep a response; returns the ``(scope, req_id)`` of the responses
        to drop from the trees (``req_id`` itself where it is not kept)."""
        if len(tokens) > self.max_tokens:
            return [(scope, req_id)]
        self._all[req_id] = (scope, tokens)
        self._own.setdefault(scope, OrderedDict())[req_id] = len(tokens)
        self._held[scope] = self._held.get(scope, 0) + len(tokens)
        self.tokens += len(tokens)
        evicted = []
        while self._all:
            if self.tokens > self.max_tokens:
                held = self._held
            elif len(self._all) > self.max_requests:
                held = {s: len(own) for s, own in self._own.items()}
            else:
                break
            scope = max(held, key=lambda s: (held[s], -next(iter(self._own[s]))))
            own = self._own[scope]
            old, n = own.popitem(last=False)
            del self._all[old]
            self.tokens -= n
            self._held[scope] -= n
            if not own:
                del self._own[scope], self._held[scope]
            evicted.append((scope, old))
        return evicted
