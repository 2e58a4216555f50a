"""ftrain: the library behind the example at the top of the repository (`main.py`,
`megatron_actor.py`, `dispatch.py`, `checkpoint.py`): fault-tolerant distributed training on
Ray and Megatron-Core. Its parts, each a folder (docs/architecture.md: what each owns and the
direction of their imports): `config` and `failures` (leaves), `distributed`, `objectives`,
`ops`, `data`, `state`, `rl`, `engines`, `control`, `recovery`, and `trainer` (the driver's loop),
with `testbeds` for tests and benchmarks. Nothing here imports the example: it hands the library
its rank actor class (`ActorGroup`), its checkpoint manager (`Trainer`) and the dispatch of each
actor method (`dispatch.register`)."""
