"""The engine actor of one rank: its scheduler core and its step protocol (DESIGN.md §2, §4).

Glossary (one meaning per name; DESIGN.md's glossary plus the engine's own words):
- step: one forward of the rank; `StepBatch` is what the scheduler planned for it (batch.py),
  `StepPlan` the message the gpu actor runs, `StepResult` its answer; `StepRunner` (step.py) takes
  a batch from planning to its result, once for the engine loop and the expert-parallel loop.
- flow (flow.py): `StepFlow`, the step's rules without I/O (which replies are due, the order
  they are applied in, the steps at the gpu), driven by StepRunner and by replay alike.
- RuntimePlan: values found at boot (block and slot counts, graph sizes), never the step's plan.
- wire (wire.py): pure translations between messages and the scheduler, shared with replay.
- history (history.py): a request's checkpoints and staleness counters. Recording (the
  `--record` log, actors/record.py) is a different thing: the actor framework's message log.
- block: a KV page of `block_size_tokens`; `slot_mapping`: each new token's KV cell
  (block * block_size + offset). slot: a Mamba state cell (live, or a snapshot slot).
- mirror: the engine's exact copy of an actor's state (prefix.py: the allocator's prefix index;
  mamba.py: the Mamba slots), kept by the same core code so a match is decided one way.
- EpConsensus (ep.py): the ZMQ consensus rounds of an expert-parallel group of engines; the gpu
  side's torch.distributed group is `ops.expert_parallel.EPGroup`.
- check (check.py): `taipan replay --check` for an engine log.
"""
