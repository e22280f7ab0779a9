"""What a run leaves on disk and how it is steered: `run_dir` (the directory, its marks, checkpoints, resume),
`run_control` (stop / pause files, signals), `metrics_log` (metrics.jsonl and the console), `grids` (sample grids)."""
