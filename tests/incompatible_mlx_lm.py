"""Test-only launcher: mlx-lm as a later version might be, and
mlx_lm_suffix installed after that change. CHANGE picks what changed:

- ``signature``: ``ResponseGenerator._tokenize`` takes one more parameter
  than mlx-lm 0.32.x has;
- ``missing``: ``ResponseGenerator._next_request``, a private method that
  mlx_lm_suffix wraps, is gone (deleted from the class: the stock server's
  own generation loop calls it, so a server cannot serve there; the
  generate command and API do not use it).

    MLX_LM_SUFFIX_AUTOLOAD=0 python tests/incompatible_mlx_lm.py CHANGE server ARGS...
    MLX_LM_SUFFIX_AUTOLOAD=0 python tests/incompatible_mlx_lm.py CHANGE generate ARGS...
    MLX_LM_SUFFIX_AUTOLOAD=0 python tests/incompatible_mlx_lm.py CHANGE api MODEL

``server`` and ``generate`` run mlx-lm's ``main()`` with ARGS. ``api`` prints
stock ``mlx_lm.generate``'s text, then what ``stream_generate`` answers to a
:class:`SuffixDrafter` and to ``"suffix"`` as draft model, one line each.
"""

import sys

import mlx_lm.server as server

change = sys.argv.pop(1)
if change == "signature":
    stock_tokenize = server.ResponseGenerator._tokenize

    def _tokenize(self, tokenizer, request, args, segment=True):
        return stock_tokenize(self, tokenizer, request, args)

    server.ResponseGenerator._tokenize = _tokenize
elif change == "missing":
    del server.ResponseGenerator._next_request
else:
    sys.exit(f"unknown change {change!r}: signature or missing")

import mlx_lm  # noqa: E402

import mlx_lm_suffix  # noqa: E402, F401

if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    sys.argv = [f"mlx_lm.{mode}", *args]
    if mode == "server":
        server.main()
    elif mode == "generate":
        sys.modules["mlx_lm.generate"].main()
    else:
        model, tokenizer = mlx_lm.load(args[0])
        print(mlx_lm.generate(model, tokenizer, "one two three one two", max_tokens=8))
        for draft_model in (mlx_lm_suffix.SuffixDrafter(), "suffix"):
            try:
                mlx_lm.generate(model, tokenizer, "one two", max_tokens=4, draft_model=draft_model)
            except Exception as e:
                print(f"{type(e).__name__}: {e}")
