"""Operations: Ray metrics, key=value event lines and the progress bar (`metrics`), end-of-run
plots (`plots`), the capacity planner and its fitted recovery-cost model (`planner`,
`planner_data.json`), model FLOPs per token (`flops`). Imports `config` and `failures` only."""
