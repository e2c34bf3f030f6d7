"""The command-line options of suffix decoding, for ``mlx_lm.generate``
(``--suffix-draft``) and ``mlx_lm.server`` (``--draft suffix``).

Both take the ``--suffix-*`` drafter options of :func:`add_drafter_arguments`
and default ``--num-draft-tokens`` to :data:`DEFAULT_NUM_DRAFT_TOKENS` when
drafting with suffix trees (to mlx-lm's default otherwise). The server adds
``--suffix-cache-scope``, ``--suffix-cache-file``, ``--suffix-log-interval``
and ``--suffix-metrics-port`` / ``--suffix-metrics-host``.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, List, Optional

from ..drafter import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_CACHED_TOKENS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_SPEC_OFFSET,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_TOKEN_PROB,
    DEFAULT_NUM_DRAFT_TOKENS,
    SuffixDrafter,
)
from ..internals import Attached
from ..persistence import SAVE_INTERVAL_S
from ..policy.rules import POLICIES

SUFFIX = "suffix"
SCOPES = ("global", "user")
#: ``--suffix-cache-scope header:NAME``: the prefix, and what NAME may be (an HTTP token).
HEADER_SCOPE = "header:"
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Seconds between two ``SpecDecoding metrics`` log lines, as vLLM's.
DEFAULT_LOG_INTERVAL = 10.0
# mlx-lm's own --num-draft-tokens default, of each parser.
_stock_num_draft_tokens: Attached[int] = Attached()


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--suffix-*`` drafter knobs to a CLI parser."""
    group = parser.add_argument_group("suffix decoding (mlx-lm-suffix)")
    group.add_argument(
        "--suffix-max-tree-depth",
        type=int,
        default=DEFAULT_MAX_TREE_DEPTH,
        help="Depth of the suffix trees (longest context matched; a draft is at "
        f"most ~depth*f/(1+f) tokens at spec factor f). Default: {DEFAULT_MAX_TREE_DEPTH}",
    )
    group.add_argument(
        "--suffix-max-cached-requests",
        type=int,
        default=DEFAULT_MAX_CACHED_REQUESTS,
        help="Earlier responses kept in the global suffix cache (0 disables it: no "
        "request drafts from another's prompt or response, in flight or finished). "
        f"Default: {DEFAULT_MAX_CACHED_REQUESTS}",
    )
    group.add_argument(
        "--suffix-max-cached-tokens",
        type=int,
        default=DEFAULT_MAX_CACHED_TOKENS,
        help="Total tokens of cached responses kept (0 disables the global cache, as "
        "above). Past either bound, the cache scope holding the most loses its oldest "
        "response; a response longer than this is not kept. "
        f"Default: {DEFAULT_MAX_CACHED_TOKENS}",
    )
    group.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=DEFAULT_MAX_SPEC_FACTOR,
        help="A suffix trees' draft is at most match_length * factor + offset tokens "
        "(prompt copies are capped by --num-draft-tokens only). "
        f"Default: {DEFAULT_MAX_SPEC_FACTOR}",
    )
    group.add_argument(
        "--suffix-max-spec-offset",
        type=float,
        default=DEFAULT_MAX_SPEC_OFFSET,
        help=f"See --suffix-max-spec-factor. Default: {DEFAULT_MAX_SPEC_OFFSET}",
    )
    group.add_argument(
        "--suffix-min-token-prob",
        type=float,
        default=DEFAULT_MIN_TOKEN_PROB,
        help="Stop a draft at a token whose estimated probability is below "
        f"this. Default: {DEFAULT_MIN_TOKEN_PROB}",
    )
    group.add_argument(
        "--suffix-policy",
        choices=list(POLICIES),
        default="adaptive",
        help="'adaptive': each step's draft length (per batch for concurrent "
        "requests) is chosen from the trees' probabilities and the measured cost "
        "of verifying it; 'fixed': draft as long as the trees allow (up to "
        "--num-draft-tokens). Default: adaptive",
    )


def cache_scope(value: str) -> str:
    """The ``--suffix-cache-scope`` value: ``global``, ``user`` or
    ``header:NAME`` (NAME an HTTP header name). Raises
    ``argparse.ArgumentTypeError`` otherwise."""
    if value in SCOPES:
        return value
    if value.startswith(HEADER_SCOPE) and _HEADER_NAME.fullmatch(value[len(HEADER_SCOPE) :]):
        return value
    raise argparse.ArgumentTypeError(
        f"invalid choice: {value!r} (choose global, user or header:NAME, "
        "e.g. header:X-Forwarded-User)"
    )


def drafter_from_args(args: argparse.Namespace) -> SuffixDrafter:
    """A drafter configured from parsed ``--suffix-*`` arguments. Raises
    ``ValueError`` for out-of-range values."""
    return SuffixDrafter(
        num_draft_tokens=args.num_draft_tokens,
        max_tree_depth=args.suffix_max_tree_depth,
        max_cached_requests=args.suffix_max_cached_requests,
        max_cached_tokens=args.suffix_max_cached_tokens,
        max_spec_factor=args.suffix_max_spec_factor,
        max_spec_offset=args.suffix_max_spec_offset,
        min_token_prob=args.suffix_min_token_prob,
        policy=args.suffix_policy,
    )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--suffix-draft`` and the drafter knobs to ``mlx_lm.generate``'s
    parser (after its own options)."""
    parser.add_argument(
        "--suffix-draft",
        action="store_true",
        help="Speculative decoding with suffix trees of the prompt and of "
        "earlier outputs (mlx-lm-suffix); no draft model needed. With "
        "--draft-model, the draft model drafts where the trees have nothing worth "
        f"verifying. --num-draft-tokens defaults to {DEFAULT_NUM_DRAFT_TOKENS} with it.",
    )
    add_drafter_arguments(parser)
    _defer_num_draft_tokens(parser)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--draft suffix``, the drafter knobs and the server's cache
    options to ``mlx_lm.server``'s parser (after its own options)."""
    parser.add_argument(
        "--draft",
        choices=[SUFFIX],
        default=None,
        help="Speculative decoding without a draft model: 'suffix' drafts from "
        "suffix trees of the prompt and of earlier responses (mlx-lm-suffix); with "
        "--draft-model too, the draft model drafts where the trees have nothing worth "
        "verifying, and requests stay batched. "
        f"--num-draft-tokens defaults to {DEFAULT_NUM_DRAFT_TOKENS} with it.",
    )
    _defer_num_draft_tokens(parser)
    add_drafter_arguments(parser)
    group = parser.add_argument_group("suffix decoding server options (mlx-lm-suffix)")
    group.add_argument(
        "--suffix-cache-scope",
        type=cache_scope,
        default="global",
        metavar="{global,header:NAME,user}",
        help="'global': every request drafts from all earlier responses and the "
        "prompts and responses in flight (one client's speed and draft counts "
        "reveal what others' contained). 'header:NAME' (e.g. "
        "header:X-Forwarded-User): only from requests with the same value of "
        "request header NAME, which an authenticating proxy in front of the "
        "server must set (replacing any the client sent); requests without it "
        "share nothing. 'user': by the request's 'user' field and "
        "'Authorization: Bearer' value, which mlx_lm.server never checks: any "
        "client can claim anyone's, so it isolates only behind a proxy that "
        "verifies both. Default: global",
    )
    group.add_argument(
        "--suffix-cache-file",
        default=None,
        metavar="PATH",
        help="Warm the suffix cache from PATH at start-up and save new responses "
        "to it (atomically; on shutdown and at most every "
        f"{SAVE_INTERVAL_S:g} s). A missing or invalid file starts empty (one "
        "warning; the file is kept until new responses are saved to it).",
    )
    group.add_argument(
        "--suffix-log-interval",
        type=_seconds,
        default=DEFAULT_LOG_INTERVAL,
        metavar="SECONDS",
        help="Log a 'SpecDecoding metrics' line (mean acceptance length, accepted and "
        "drafted tokens/s, per-position acceptance, refused drafts) at INFO every "
        f"SECONDS while requests are served; 0 turns it off. Default: {DEFAULT_LOG_INTERVAL:g}",
    )
    group.add_argument(
        "--suffix-metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Also serve every Prometheus metric on PORT (of --suffix-metrics-host), "
        "the operator's scrape address: GET /metrics on the server's own port shows "
        "only the settings unless --suffix-cache-scope is global. Default: none",
    )
    group.add_argument(
        "--suffix-metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="Address of --suffix-metrics-port. Default: 127.0.0.1",
    )


def finalize_generate_args(
    parser: argparse.ArgumentParser, ns: argparse.Namespace
) -> Optional[SuffixDrafter]:
    """Resolve defaults and check the suffix options once ``mlx_lm.generate``
    has parsed; the drafter ``--suffix-draft`` asks for, or None."""
    return _finalize(parser, ns, ns.suffix_draft, "--suffix-draft")


def finalize_server_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Resolve defaults and check the suffix options once ``mlx_lm.server``
    has parsed (errors exit as argparse's do)."""
    if getattr(ns, "draft_model", None) == SUFFIX:
        # --draft-model suffix (or the prefix --draft-m...): never a model.
        ns.draft_model = None
        ns.draft = SUFFIX
    suffix = enabled(ns)
    if not suffix:
        scope = ns.suffix_cache_scope
        for flag, value in (
            ("--suffix-cache-file", ns.suffix_cache_file),
            (f"--suffix-cache-scope {scope}", scope != "global" or None),
            ("--suffix-metrics-port", ns.suffix_metrics_port),
        ):
            if value is not None:
                parser.error(f"{flag} needs --draft suffix")
    _finalize(parser, ns, suffix, "--draft suffix")


def refuse_suffix_options(
    parser: argparse.ArgumentParser,
    ns: argparse.Namespace,
    extras: List[str],
    refusal: Callable[[str], str],
    server: bool = False,
) -> None:
    """Exit with status 2 and the one line ``refusal(option)`` where a stock
    parser's command line asks for suffix decoding: a ``--suffix-*`` option
    (unknown to it) or, for the ``server``, ``--draft suffix`` (which it
    reads as ``--draft-model suffix``)."""
    options = [a for a in extras if a.startswith("--suffix-")]
    if server and getattr(ns, "draft_model", None) == SUFFIX:
        options.insert(0, f"--draft {SUFFIX}")
    if options:
        parser.exit(2, f"{parser.prog}: error: {refusal(options[0])}\n")


def _seconds(value: str) -> float:
    """A ``--suffix-log-interval``: seconds, 0 or more."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value: {value!r} (seconds, 0 or more)")
    return seconds


def enabled(cli_args: argparse.Namespace) -> bool:
    """Whether the server's parsed CLI asks for ``--draft suffix``."""
    return getattr(cli_args, "draft", None) == SUFFIX


def _defer_num_draft_tokens(parser: argparse.ArgumentParser) -> None:
    # Resolved by _finalize: the default depends on whether suffix drafting is on.
    _stock_num_draft_tokens.set(parser, parser.get_default("num_draft_tokens"))
    parser.set_defaults(num_draft_tokens=None)


def _finalize(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, suffix: bool, flag: str
) -> Optional[SuffixDrafter]:
    if ns.num_draft_tokens is None:
        ns.num_draft_tokens = (
            DEFAULT_NUM_DRAFT_TOKENS if suffix else _stock_num_draft_tokens.get(parser)
        )
    if not suffix:
        return None
    try:
        return drafter_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
