"""Tools around the runtime package: the ``mlx-lm-suffix`` command line
(:mod:`.cli`), benchmarks, replay, parity and soak checks, workloads, tiny
random models and the one ``mlx_lm.server`` launcher they share.

The runtime modules never import this package.
"""
