from mlx_lm_suffix.cli import main

main()
