"""Runtime parts whose GPU path no CPU test can reach, each run on the CPU here and on CUDA
where a GPU is lent (``pytest -m gpu``; the CUDA cases skip visibly without one):

- a traced pipeline split of Hugging Face GPT-2 into four stages, traced with the example on
  the model's device (``trace_example``: a CPU example against a CUDA model failed the
  trace), the attention mask relayed past the stages that do not read it, equals the model;
- the fp16 overflow check leaves its flag on the gradients' device (NCCL reduces no CPU
  tensor);
- the busy clock times device work with the device's events.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch

from hetplan import zoo
from hetplan.ir.capture import capture
from hetplan.ir.plan_sections import Stage
from hetplan.runtime import pipeline as pipeline_mod
from hetplan.runtime.busy_clock import BusyClock, cuda_events
from hetplan.runtime.handlers.stages import trace_example
from hetplan.runtime.precision import unscale_and_check

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_split_in_four_on_the_device_equals_the_model(device: str) -> None:
    model = zoo.build("tiny-gpt2", device="cpu", seed=0).eval()
    args, kwargs = zoo.example_inputs("tiny-gpt2", batch=1, device="cpu")
    kwargs = {k: v for k, v in kwargs.items() if k != "use_cache"} | {"use_cache": False}
    names = [lay.name for lay in capture(model, args, kwargs).layers]
    cuts = [names.index(n) for n in ("transformer.h.0", "transformer.h.1", "transformer.ln_f")]
    bounds = [0, *cuts, len(names)]
    stages = [Stage(index=s, first_layer=a, last_layer=b - 1, layer_names=tuple(names[a:b]),
                    ranks=(s,)) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    model = model.to(device)
    ctx = SimpleNamespace(model=model, example_args=args,
                          layout=SimpleNamespace(micro_batch_size=2))
    example = trace_example(ctx)  # type: ignore[arg-type]
    assert example[0].device.type == device
    pipe, _ = pipeline_mod._trace(model, tuple(example), kwargs,
                                  pipeline_mod.split_points(names, stages))
    assert pipeline_mod._relay_skips(pipe) >= 1  # the mask, made by stage 0, read by all
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, call in enumerate(calls):
        for a in call.args:  # only the stage before feeds a stage
            while a.op == "call_function" and a.target is operator.getitem:
                a = a.args[0]
            assert (a.op == "placeholder" and k == 0) or calls.index(a) == k - 1
    with torch.no_grad():
        got = pipe(example[0], **kwargs)
        want = model(example[0], **kwargs).logits
    got = got[0] if isinstance(got, tuple) else got
    assert got.device.type == device
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_flag_stays_on_the_gradients_device(device: str) -> None:
    grads = [torch.full((3,), 4.0, device=device), torch.tensor([2.0, float("inf")],
                                                                device=device)]
    flag = unscale_and_check(grads, 2.0)
    assert flag.device.type == device and float(flag) == 1.0
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    clean = [torch.full((2,), 8.0, device=device)]
    flag = unscale_and_check(clean, 4.0)
    assert float(flag) == 0.0 and clean[0].tolist() == [2.0, 2.0]
    assert unscale_and_check([], 2.0, torch.device(device)).device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_busy_clock_uses_the_devices_events(device: str) -> None:
    model = torch.nn.Linear(256, 256, device=device)
    events = cuda_events(model)
    assert (events is None) == (device == "cpu")
    clock = BusyClock(events)
    clock.reset()
    x = torch.randn(256, 256, device=device)
    with clock.busy():
        for _ in range(10):
            x = model(x)
    span = clock.settle(host_s=1.0)
    if device == "cpu":
        assert span == 1.0  # the host's time, as given
    else:  # the block lies inside the step: its device time is no more than the span
        assert 0 < clock.busy_s <= span
