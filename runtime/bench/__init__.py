"""`taipan bench` (DESIGN.md §11): ours vs Hugging Face transformers vs the hardware. Its parts,
each importing only those listed after it:
  command        the CLI flags, the run of one workload, the results file, the printed lines
  generate       N text prompts x M tokens vs HF `generate` (the default workload)
  decode         step time per batch vs the floor, for ours' modes and HF's
  offline        many requests of ShareGPT-like lengths, all at once
  shared_prefix  prefix caching off vs on
  http_load      concurrent streams, some dropped, over HTTP vs AsyncClient
  relay          one coordinator's relay capacity (synthetic engines, no model)
  weight_sync    a trainer's weights into a running taipan vs the raw broadcast (RL)
  structured     concurrent streams with and without a json_schema (structured outputs' cost)
  spec           speculative decoding (n-gram) off vs on, input-grounded and free generation
  relay_peers    the relay run's processes (`python -m taipan.bench.relay_peers`)
  common         prompt makers and helpers the families share
The families never import each other. What needs torch lives in ops/ (DESIGN.md §1):
ops/hf_bench.py (the Hugging Face side) and ops/hardware.py (copy bandwidth, matmul rate, model
bytes: the floors), imported inside the families' functions, on use: `taipan --help` never
loads torch.
"""

from taipan.bench.command import add_arguments, run

__all__ = ["add_arguments", "run"]
