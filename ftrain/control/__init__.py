"""Control plane: the driver's actor group and its placement (`actor_group`: workers, the pool
of pre-warmed spares, generations; `actor_slot`), a rank actor's life (`lifecycle`), failure
detection (`health`: heartbeats, deadlines extended by progress, hung ranks, lost nodes, the abort
round) through the node agents and their fan-out tree (`node_agent`, `agent_tree`, `ray_batch`),
a generation's join barrier (`rendezvous`), one driver per run (`run_lease`), driver failover
(`driver_failover`), a driver's local Ray (`local_ray`) and the device probe (`device_probe`).
May call `state`, `data`, `distributed`, `config`, `failures`; never an engine (ranks are Ray
actors it is given) and never the recovery protocol."""
