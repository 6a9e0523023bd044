"""Random stragglers in a cluster spec: a Bernoulli delay per device and iteration.

``slowdown`` on a device type or node group (:mod:`hetplan.ir.cluster`) is a fixed factor. The
model here adds the dynamic heterogeneity of shared clusters that SDPipe (Miao et al., PVLDB
2023, §5.1) was evaluated under: at every training iteration, each affected device is
independently delayed by ``delay_s`` with probability ``probability``. The paper's settings
are in :data:`PAPER_SETTINGS` (hete-A: +0.2 s, hete-B: +0.6 s for BERT; +0.1 s / +0.3 s for
ResNet-50; p = 0.1).

In a cluster file::

    stragglers: {probability: 0.1, delay_s: 0.3}            # every device
    stragglers: {probability: 0.1, delay_s: 0.6, nodes: [spot]}   # only node group 'spot'

The field is optional; a spec without it has the same fingerprint as before the field existed.
Consumers: the group-sync pass's throughput simulator and the runtime's straggler emulation.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hetplan.ir.fields import strict_float

__all__ = ["PAPER_SETTINGS", "StragglerSpec"]

_Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False),
                        BeforeValidator(strict_float)]
_Delay = Annotated[float, Field(gt=0.0, le=3600.0, allow_inf_nan=False),
                   BeforeValidator(strict_float)]


class StragglerSpec(BaseModel):
    """Per-iteration random delays of devices.

    Attributes:
        probability: chance, per device and iteration, that the device is delayed (0..1).
        delay_s: the delay in seconds when it is.
        nodes: node-group names whose devices straggle; empty means every device.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    probability: _Probability
    delay_s: _Delay
    nodes: tuple[Annotated[str, Field(min_length=1, max_length=200)], ...] = ()

    @property
    def expected_delay_s(self) -> float:
        """Mean extra time per device and iteration (probability x delay)."""
        return self.probability * self.delay_s


#: The paper's heterogeneity settings, ``(setting, model) -> StragglerSpec`` (None:
#: homogeneous). Models: ``"bert"`` and ``"resnet"``.
PAPER_SETTINGS: dict[tuple[str, str], StragglerSpec | None] = {
    ("homogeneous", "bert"): None,
    ("homogeneous", "resnet"): None,
    ("hete-a", "bert"): StragglerSpec(probability=0.1, delay_s=0.2),
    ("hete-a", "resnet"): StragglerSpec(probability=0.1, delay_s=0.1),
    ("hete-b", "bert"): StragglerSpec(probability=0.1, delay_s=0.6),
    ("hete-b", "resnet"): StragglerSpec(probability=0.1, delay_s=0.3),
}
