"""Every tensor the runtime makes is made on a device it names.

On GPUs the job's groups are NCCL's, which take CUDA tensors only: a flag, a size or a
receive buffer made with torch's default device (the CPU) fails the collective it is made
for, and only there (the CPU tests run gloo, which takes anything, so no test on this
machine can see it). Four such tensors were found when this check was written: the fp16
overflow flag of the ZeRO optimizers, the Zen size exchanges and the heterogeneous pipeline's
headers and receive buffers. So: a tensor factory in ``hetplan/runtime`` names its
``device``, is moved with ``.to(...)`` at once, or says why it belongs in host memory with a
``# host`` comment on a line of its statement (a gloo group's buffer, a pinned staging copy,
a probe that never meets a collective).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hetplan.runtime

FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint"}
ROOT = Path(hetplan.runtime.__file__).parent


def _undeviced(path: Path, root: Path = ROOT) -> list[str]:
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    moved = set()  # every call of a chain that ends in ``.to(...)``: x.view(...).to(device)
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to":
            inner = n.func.value
            while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
                moved.add(id(inner))
                inner = inner.func.value
    stmt: dict[int, tuple[int, int]] = {}  # a call -> the lines of its innermost statement
    for st in ast.walk(tree):
        if isinstance(st, ast.stmt):
            lo, hi = st.lineno, st.end_lineno or st.lineno
            for n in ast.walk(st):
                if id(n) not in stmt or hi - lo < stmt[id(n)][1] - stmt[id(n)][0]:
                    stmt[id(n)] = (lo, hi)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords) or id(node) in moved:
            continue
        lo, hi = stmt.get(id(node), (node.lineno, node.end_lineno or node.lineno))
        if any("# host" in line for line in lines[lo - 1: hi]):
            continue
        out.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                   f"{lines[node.lineno - 1].strip()}")
    return out


def test_runtime_tensors_name_their_device() -> None:
    bad = [line for p in sorted(ROOT.rglob("*.py")) for line in _undeviced(p)]
    assert not bad, ("tensors made on torch's default device (CPU), which an NCCL "
                     "collective refuses; pass device=..., or mark a host tensor '# host':\n"
                     + "\n".join(bad))


def test_the_check_sees_a_bare_factory(tmp_path: Path) -> None:
    """The scan itself: a bare factory is reported; a named device, a move and a marked
    host tensor are not."""
    f = tmp_path / "m.py"
    f.write_text("import torch\n"
                 "a = torch.zeros(1)\n"
                 "b = torch.zeros(1, device=x.device)\n"
                 "c = torch.tensor([1]).to(d)\n"
                 "e = torch.empty(3,\n"
                 "                dtype=torch.uint8)  # host: a gloo buffer\n")
    got = _undeviced(f, tmp_path)
    assert [g.split(":")[1] for g in got] == ["2"]


def test_stages_are_traced_with_the_example_on_the_models_device() -> None:
    """The worker builds its examples on the CPU and moves the model to its GPU; the
    pipeline stages are traced with one micro-batch of them on the model's device (a CPU
    example against a model on another device failed the trace). ``meta`` stands in for
    the GPU here."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from hetplan.runtime.handlers.stages import trace_example

    ctx = SimpleNamespace(model=nn.Linear(4, 4, device="meta"),
                          example_args=(torch.ones(1, 4), "not a tensor"),
                          layout=SimpleNamespace(micro_batch_size=3))
    x, other = trace_example(ctx)  # type: ignore[arg-type]
    assert x.device.type == "meta" and tuple(x.shape) == (3, 4)
    assert other == "not a tensor"
