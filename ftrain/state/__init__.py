"""State: where copies of the training state live and how they are trusted. A checkpoint's
format (`manifest`: files, the manifest that commits it, whether it fits this run), its file I/O
shared by the example's `CheckpointManager` and the engines (`checkpoint_io`, `hashed_file`,
`safe_load`: loading never runs code), which run a checkpoint belongs to (`run_identity`), pinned
and shared host memory (`host_memory`), in-memory snapshots and their holders (`snapshots`), and
the shard keeper with its courier (`keeper`, `courier`). May call `data`, `distributed`, `config`,
`failures`."""
