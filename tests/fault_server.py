"""Test-only launcher: ``mlx_lm.server`` (patched by mlx-lm-suffix as
usual) whose loaded models raise in chosen forwards and report the widest
forward that mlx-lm-suffix runs. Started as the bench's scripted server
(``mlx_lm_suffix.tools.bench.serve_main``): with ``$MLX_LM_SUFFIX_SCRIPT``
the greedy outputs follow a script.

    python tests/fault_server.py --model ... --draft suffix ...

Every forward that the loop, the batch or a rollback of mlx-lm-suffix runs
(not mlx-lm's prompt processing, nor the policy's cost measurement) that is
wider per row than all before it prints ``fault_server: widest forward N``.

Environment:

- ``FAULT_TOKEN``: a token id. A forward over more than one token per row
  (a verification forward, or a prompt chunk) that is not the first forward
  of its cache and contains this token raises ``RuntimeError`` instead of
  running. Pick a token that no prompt contains: then only verification
  forwards (a draft, or a pending token followed by a draft) can raise.
- ``FAULT_MAX``: how many times to raise (default 1); later forwards run.
- ``STALL_WIDTH``: a forward over at least this many tokens per row (a long
  prompt's prefill) never ends: it prints ``fault_server: stalled`` and
  blocks its thread for good.
- ``SHUTDOWN_GRACE_S``: mlx-lm-suffix's grace after SIGTERM
  (:data:`mlx_lm_suffix.patches.serving.SHUTDOWN_GRACE_S`).

The product code has no hook for this: the launcher swaps the class of
each model the server loads for a subclass whose ``__call__`` checks.
"""

import os
import sys
import threading

import mlx.core as mx
import mlx_lm.server as server

from mlx_lm_suffix.patches import serving
from mlx_lm_suffix.tools.bench import serve_main

FAULT_TOKEN = int(os.environ.get("FAULT_TOKEN", "-1"))
FAULT_MAX = int(os.environ.get("FAULT_MAX", "1"))
STALL_WIDTH = int(os.environ.get("STALL_WIDTH", "0"))
if "SHUTDOWN_GRACE_S" in os.environ:
    serving.SHUTDOWN_GRACE_S = float(os.environ["SHUTDOWN_GRACE_S"])
_faults = [0]
_widest = [0]
# The modules whose forwards verify drafts (or replay them).
_DRAFTING = {"mlx_lm_suffix.loop", "mlx_lm_suffix.batch", "mlx_lm_suffix.rollback"}


def _offset(cache):
    if not cache:
        return 0
    offset = getattr(cache[0], "offset", 0)
    if isinstance(offset, mx.array):
        return int(offset.max().item()) if offset.size else 0
    return int(offset)


def _should_fail(inputs, cache) -> bool:
    if FAULT_TOKEN < 0 or _faults[0] >= FAULT_MAX:
        return False
    if inputs.ndim != 2 or inputs.shape[1] < 2 or _offset(cache) == 0:
        return False
    return bool(mx.any(inputs == FAULT_TOKEN).item())


def _note_width(inputs) -> None:
    caller = sys._getframe(2).f_globals.get("__name__")
    width = inputs.shape[-1]
    if caller in _DRAFTING and width > _widest[0]:
        _widest[0] = width
        # One write per line: print() writes the newline apart, and a log
        # line of another thread can land in between.
        sys.stderr.write(f"fault_server: widest forward {width}\n")
        sys.stderr.flush()


def _make_faulty(model) -> None:
    cls = type(model)
    if getattr(cls, "_fault_injected", False):
        return

    def __call__(self, inputs, *args, **kwargs):
        cache = kwargs.get("cache", args[0] if args else None)
        _note_width(inputs)
        if STALL_WIDTH and inputs.ndim == 2 and inputs.shape[1] >= STALL_WIDTH:
            sys.stderr.write("fault_server: stalled\n")
            sys.stderr.flush()
            threading.Event().wait()
        if _should_fail(inputs, cache):
            _faults[0] += 1
            print(f"fault_server: injected fault {_faults[0]} "
                  f"(inputs {tuple(inputs.shape)})", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected fault: token {FAULT_TOKEN} in a verification forward")
        return cls.__call__(self, inputs, *args, **kwargs)

    model.__class__ = type(f"Faulty{cls.__name__}", (cls,), {
        "__call__": __call__, "_fault_injected": True})


_load = server.ModelProvider._load


def _faulty_load(self, *args, **kwargs):
    _load(self, *args, **kwargs)
    if self.model is not None:
        _make_faulty(self.model)


server.ModelProvider._load = _faulty_load

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    serve_main()
