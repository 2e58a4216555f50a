"""Distributed: the rank <-> (tp, cp, dp, pp) arithmetic in Megatron's order (`parallel_dims`),
how one call is fanned out to the ranks and gathered back (`fanout`: `Dispatch`, `Cut`,
`call_args`), and the process-group lifecycle both engines share (`comms`: the node's interface,
threaded abort, gloo socket shutdown, NCCL group close, interruptible waits). Imports `config`
only."""
