"""Test-only launcher: ``tests/fault_server.py`` (faulty forwards, the same
environment) with every drafter's verification cost frozen flat: a forward
of any width costs one plain step, and nothing is learnt from real timings.

    python tests/flat_cost_server.py --model ... --draft suffix ...

Under the default (adaptive) policy whether a draft is verified depends on
the cost curve learnt from the machine's timings: under load a batch can
find a repeat's verification too dear and never run the forward that a test
injects its fault into. With a flat curve the adaptive rules verify every
draft whose estimates promise a token (and a batch's, past its margin), the
same on any machine. (The fixed policy ignores the curve.)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fault_server  # noqa: E402  (patches the model loader)

from mlx_lm_suffix.patches import serving  # noqa: E402
from mlx_lm_suffix.policy import VerifyCost  # noqa: E402

_drafter_from_args = serving.drafter_from_args


def drafter_from_args(args):
    drafter = _drafter_from_args(args)
    # Set before the model loads: the server then measures no curve.
    drafter.policy.cost = VerifyCost({1: 1.0, 2: 1.0}, smoothing=0.0)
    return drafter


serving.drafter_from_args = drafter_from_args

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    fault_server.serve_main()
