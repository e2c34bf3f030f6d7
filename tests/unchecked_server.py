"""Test-only launcher: ``mlx_lm.server`` (patched by mlx-lm-suffix as
usual) without the handler's checks of sampling and penalty values
(:func:`mlx_lm_suffix.patches.validation.check_generation_fields` does
nothing), so that values which fail inside generation reach it: what
:mod:`mlx_lm_suffix.patches.isolation` must contain.

    python tests/unchecked_server.py --model ... --draft suffix ...
"""

import sys

from mlx_lm_suffix.patches import validation
from mlx_lm_suffix.tools.bench import serve_main


def check_generation_fields(fields, vocabulary):
    return None


validation.check_generation_fields = check_generation_fields

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    serve_main()
