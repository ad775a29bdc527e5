"""Tensor parallelism: a Llama-family model sharded over ranks, one scheduler for them all.

`plan.py` (what each rank holds), `weights.py` (each rank reads its own slices),
`sharded_llama.py` (the model with its collectives), `comm.py` (the ranks' process groups),
`rank.py` (a rank's shard, pools and commands), `worker.py` (ranks 1..N-1),
`executor.py` (rank 0: the engine's executor), `transport.py` (tier moves per shard),
`build.py` (used by `kvpilot.model.build`). See docs/architecture.md.
"""
