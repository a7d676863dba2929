"""The sliding window a loaded model reports to its engine (`ModelLoaded.sliding_window`): the KV
behind it may go back to the pool (actors/engine/scheduler.py); and a model whose windowed layers
sit among ones that see their whole context (`windowed_layers`: per-layer-group KV, the windowed
layers' keys in a pool of their own, actors/engine/local_kv.py).

Reads a model config, decides nothing else. Must not touch: the model, the KV cache, the
engine's use of the number.
"""

from __future__ import annotations


def kv_window(config) -> int:
    """W > 0 when every attention layer of the model reads at most W keys back (a query at p:
    keys p - W < k <= p; W the largest window over the layers), else 0: some layer sees its
    whole context (Gemma 3's global layers, Qwen2/3 windowing only some), or the config says
    nothing of windows (then nothing may be freed early). Reads the per-layer windows of the
    Llama-skeleton configs (`layer_window(i)`, None: the whole context); a family without
    them has none."""
    layer_window = getattr(config, "layer_window", None)
    if layer_window is None:
        return 0
    windows = [layer_window(i) for i in range(config.num_layers)]
    if not windows or not all(windows):
        return 0
    return int(max(windows))


def windowed_layers(config) -> tuple[int, tuple[bool, ...]] | None:
    """(W, which layers have a window) when some attention layers attend within a window and
    others see their whole context (Gemma 3's local and global layers, Qwen2/3 windowing only
    some), W the largest window; None otherwise (no window, or every layer has one: the engine
    then frees behind the whole model's window, `kv_window`). A Llama-skeleton config's
    layers are its KV layers one for one."""
    layer_window = getattr(config, "layer_window", None)
    if layer_window is None:
        return None
    windows = [layer_window(i) for i in range(config.num_layers)]
    if all(windows) or not any(windows):
        return None
    return int(max(w for w in windows if w)), tuple(bool(w) for w in windows)
