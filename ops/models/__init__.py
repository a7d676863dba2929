"""One model file per family over the shared layers (ops/layers.py, attention.py, moe.py,
mamba.py): llama.py, qwen2.py, qwen3.py, mistral.py, qwen3_moe.py, nemotron_h.py."""
