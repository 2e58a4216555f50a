"""Data: the training batch (`training_batch`), the sample address over Megatron `.bin/.idx`
datasets, SFT conversations, blends and mock data (`dataset`: rows of a step = f(data, seed,
step, DP rank)), rows of jsonl / parquet files local or on object storage (`row_files`), RL
prompt sets in veRL's layout (`prompt_set`), a rank reading its own rows (`rank_rows`) and
`main.py data prepare / inspect / stdlib` (`prepare`). May call `distributed`, `objectives`,
`config`, `failures`."""
