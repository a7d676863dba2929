"""The gpu actor (DESIGN.md §8): the only actor that imports torch. actor.py is the shell (steps
on its event loop, the device waited on in a thread), worker.py the load, pools and step
launch, forward.py the forward, sampling and CUDA graphs, controls.py suspend/resume/weight
updates, sizing.py the pools, peers.py/follower.py the
tensor-parallel followers."""
