"""Test-only launcher: ``mlx_lm.server`` (patched by mlx-lm-suffix as usual)
whose ``--draft suffix`` servers draft requests that ask for ``logprobs``.

    python tests/logprobs_drafting_server.py --model ... --draft suffix ...

A real suffix server serves those without drafting, so that their logprobs
equal stock's to the last bit (a verification forward's differ in the last
bits). Tests that read each response's token ids from its logprobs while
they check drafting (``tests/test_server_families.py``) use this launcher,
and compare logprob values within a tolerance.
"""

import sys

import mlx_lm.server as server

from mlx_lm_suffix.patches import serving

serving.wants_logprobs = lambda handler: False

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    server.main()
