"""What the gpu actor runs (DESIGN.md §1, §9): layers and models, weight loading (loader.py and
its parts), sharding for tensor/expert parallelism, weight updates and transfers, tokenizer and
chat templates. Each op dispatches to a Triton kernel (kernels/) or its torch reference."""
