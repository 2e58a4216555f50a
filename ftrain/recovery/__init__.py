"""Recovery: the protocol that turns a detected failure into training again (`fault_tolerance`:
abort, replace, rebuild, restore from the cheapest source, its pure decisions, the grow back
after a shrink, a reattaching driver's return). Reaches the ranks only through the control
plane's `ActorGroup`; may call `control`, `state`, `data`, `distributed`, `config`, `failures`."""
