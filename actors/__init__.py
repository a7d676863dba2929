"""The actors and their framework (DESIGN.md §2): base.py, channel.py, record.py, log.py,
config.py, curve.py and engine_link.py are the framework every actor shares; one subpackage per
actor (coordinator, engine, allocator, mamba_cache, gpu, client), each a pure core and a thin
shell. Subpackages never import each other; only actors/gpu imports torch."""
