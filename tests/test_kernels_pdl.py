"""Programmatic dependent launch (kernels/pdl.py): the switch, where it applies, and on a GPU
(`gpu`) a graphed one-row decode step with it on equal bitwise, replay after replay, to the
same step launched without it (a kernel that read its input before the kernel before it had
finished would show here as a changed bit)."""

from __future__ import annotations

import pytest
import torch

from taipan.kernels import pdl


def test_the_switch(monkeypatch):
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(pdl.PDL_ENV, value)
        assert pdl._enabled() is on
    monkeypatch.delenv(pdl.PDL_ENV)
    assert pdl._enabled()  # on by default
    monkeypatch.setenv(pdl.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="TAIPAN_PDL must be 0 or 1, got 'yes'"):
        pdl._enabled()


def test_never_on_the_cpu():
    assert not pdl.supported(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_every_kernel_waits_first():
    """Every Triton kernel of kernels/ takes part: a PDL parameter and `enter(PDL)` as its first
    statement (a kernel launched with the attribute that never waited could complete before the
    kernel before it, and the chain's completion would stop being transitive)."""
    import importlib
    import inspect
    import pkgutil

    import taipan.kernels as package

    kernels = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"taipan.kernels.{info.name}")
        for name, fn in vars(module).items():
            jitted = hasattr(fn, "arg_names") and hasattr(fn, "fn")  # (or interpreted)
            if jitted and name.endswith("kernel") and fn.fn.__module__ == module.__name__:
                kernels.append(name)
                assert "PDL" in fn.arg_names, name
                body = inspect.getsource(fn.fn).split("\n):", 1)[1].split("\n")
                first = next(line.strip() for line in body[1:] if line.strip())
                assert first == "enter(PDL)", (name, first)
    assert len(kernels) >= 25, kernels


@pytest.mark.gpu
def test_gpu_graphed_steps_with_pdl_equal_the_step_without(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 (Hopper) or later")
    from tests.perf.cuda_graphs import graph_of
    from tests.test_ops_fused_decode import _inputs, _model, _prefill

    assert pdl.supported(torch.device("cuda"))
    for dtype in (torch.float32, torch.bfloat16):
        model = _model("llama", 64, "cuda", dtype)
        cache = _prefill(model, "cuda", dtype)
        inputs = _inputs(cache, 1, "cuda")
        with torch.no_grad():
            monkeypatch.setattr(pdl, "ENABLED", False)
            want = model(*inputs).clone()
            monkeypatch.setattr(pdl, "ENABLED", True)
            captured = {}

            def step(model=model, inputs=inputs, captured=captured):
                captured["out"] = model(*inputs)

            graph = graph_of(step)
        for _ in range(50):
            graph.replay()
            assert torch.equal(captured["out"], want)
