from mlx_lm_suffix.tools.cli import main

main()
