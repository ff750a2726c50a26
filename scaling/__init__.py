"""The SLO controller's decision function (torch-free): signals in, workers per role out."""

from scaling.policy import HOLD, Bounds, ControllerConfig, Decision, Signals, State, decide, pressures

__all__ = ["HOLD", "pressures", "Bounds", "ControllerConfig", "Decision", "Signals", "State", "decide"]
