"""The drafter's suffix trees, one arctic-inference cache per scope, and
which finished responses their global trees keep: bounded in count and
tokens, evicted fairly across scopes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Tuple

from arctic_inference.suffix_decoding import SuffixDecodingCache

from .. import internals
from ..policy.calibration import LONG_MATCH


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


class SuffixTrees:
    """The arctic-inference caches of one drafter, one per scope (each holds
    its active requests' trees and a global tree of responses), and the
    finished responses their global trees keep (:class:`ResponseStore`).

    A scope's cache is made on first use; one with neither active requests
    nor cached responses is dropped again (except the default scope
    ``None``). The caller serialises access (the drafter's lock)."""

    def __init__(self, depth: int, max_requests: int, max_tokens: int, private: Hashable):
        self.depth = depth
        # Either bound 0: no global tree, so nothing of a request reaches another one.
        self.shared = max_requests > 0 and max_tokens > 0
        self.private = private
        self.kept = ResponseStore(max_requests, max_tokens)
        self._caches: Dict[Hashable, SuffixDecodingCache] = {}

    def __getitem__(self, scope: Hashable) -> SuffixDecodingCache:
        return self._caches[scope]

    def open(self, scope: Hashable) -> SuffixDecodingCache:
        """The cache of ``scope``, made if it has none."""
        cache = self._caches.get(scope)
        if cache is None:
            n = -1 if self.shared and scope is not self.private else 0
            cache = SuffixDecodingCache(self.depth, max_cached_requests=n)
            internals.check_arctic(cache)
            self._caches[scope] = cache
        return cache

    def keep(self, req_id: int, scope: Hashable, response: List[int]) -> int:
        """Request ``req_id`` of ``scope`` stopped: keep its ``response`` in
        the global tree as the store's bounds allow, evicting others.
        Returns how many earlier responses it evicted."""
        evicted = 0
        if req_id in self._caches[scope].cached_requests:
            for s, old in self.kept.add(req_id, scope, response):
                self._caches[s].evict_cached_response(old)
                self._drop_if_empty(s)
                evicted += old != req_id
        self._drop_if_empty(scope)
        return evicted

    def start(self, req_id: int, scope: Hashable, own: List[int], shared: List[int]) -> None:
        """Start request ``req_id`` of ``scope``: its own tree gets ``own``
        then ``shared``, its scope's global tree ``shared``."""
        cache = self.open(scope)
        cache.start_request(req_id, own)
        if shared:
            cache.add_active_response(req_id, shared)

    def extend(self, req_id: int, scope: Hashable, tokens: List[int]) -> None:
        """``tokens`` into the request's own tree and its scope's global tree
        (arctic-inference's ``add_active_response``, on its C++ trees
        directly: :data:`~mlx_lm_suffix.internals.ARCTIC`)."""
        cache = self._caches[scope]
        if not tokens:
            return
        internals.own_tree(cache, req_id).extend(0, tokens)
        seq = internals.global_sequence(cache, req_id)
        if seq is not None:
            internals.global_tree(cache).extend(seq, tokens)

    def speculate(self, req_id: int, scope: Hashable, context: List[int], limit: int,
                  factor: float, offset: float, min_prob: float) -> Tuple[List[int], List[float], int]:
        """The trees' draft after ``context``: tokens, estimates and match
        length. Each tree's is its best-scoring one (arctic-inference's
        ``SuffixTree.speculate``); of the request's own tree's and the
        global tree's, the draft from the longer match is taken (it agrees
        with more of the context; a tie: the better score, then its own).
        arctic's ``SuffixDecodingCache.speculate`` takes the better score:
        a continuation seen once in the prompt would then outscore a longer
        match's continuation that two earlier answers share and a third
        leaves. (On the C++ trees directly:
        :data:`~mlx_lm_suffix.internals.ARCTIC`.)"""
        cache = self._caches[scope]
        knobs = (limit, factor, offset, min_prob, False)
        own = internals.own_tree(cache, req_id).speculate(context, *knobs)
        other = internals.global_tree(cache).speculate(context, *knobs)
        a, b = own.match_len, other.match_len
        if a > b or (a == b and own.score >= other.score):
            return own.token_ids, own.probs, a  # (new lists each read)
        return other.token_ids, other.probs, b

    def draft(self, req_id: int, scope: Hashable, context: List[int], limit: int,
              factor: float, offset: float, min_prob: float) -> Tuple[List[int], List[float], int]:
        """The trees' draft after ``context`` (:meth:`speculate`), preferring
        a long match's.

        The tree depth bounds a match and its draft together, so a repeated
        request's own answer, after a long match, may be drafted shorter
        than the draft of a template match that several earlier answers
        share, branching where they part. So where the best draft's match
        reaches a third of :data:`~mlx_lm_suffix.policy.LONG_MATCH` (shorter
        matches are not repeats), the draft from a match of at least
        LONG_MATCH tokens is preferred (a second walk, of the last
        LONG_MATCH context tokens only), within the same limits, its match
        length read as LONG_MATCH; where the first draft goes on from it,
        the rest is kept, estimated no higher."""
        tokens, probs, match = self.speculate(req_id, scope, context, limit, factor, offset, min_prob)
        if not tokens or not LONG_MATCH // 3 <= match < LONG_MATCH:
            return tokens, probs, match
        n = int(min(limit, LONG_MATCH * factor + offset))
        if n <= 0:
            return tokens, probs, match
        # Only a match of LONG_MATCH tokens or more allows a token.
        deep, far, _ = self.speculate(req_id, scope, context[-LONG_MATCH - 1 :], n, float(n),
                                      -float(n * (LONG_MATCH - 1)), min_prob)
        if not deep:
            return tokens, probs, match
        n, low = len(deep), far[-1]
        rest = tokens[n:] if tokens[:n] == deep else []
        return deep + rest, far + [min(p, low) for p in probs[n : n + len(rest)]], LONG_MATCH

    def add(self, req_id: int, scope: Hashable, tokens: List[int]) -> int:
        """A finished response (e.g. from a file) into ``scope``'s global
        tree; how many earlier ones it evicted."""
        cache = self.open(scope)
        cache.start_request(req_id, [])
        cache.add_active_response(req_id, tokens)
        cache.stop_request(req_id)
        return self.keep(req_id, scope, tokens)

    def tree_responses(self) -> int:
        """Responses the global trees themselves hold (active requests'
        included), counted apart from the store's bookkeeping (the global
        trees' ``num_seqs()`` is O(1), unlike ``estimate_memory()``, which
        walks the tree)."""
        return sum(internals.global_tree(c).num_seqs() for c in self._caches.values())

    def _drop_if_empty(self, scope: Hashable) -> None:
        # A user scope with nothing active or cached keeps no tree around.
        cache = self._caches.get(scope)
        if (
            scope is not None
            and cache is not None
            and not cache.active_requests
            and not cache.cached_requests
        ):
            del self._caches[scope]


