"""The SLO controller's decision function (torch-free): signals in, workers per role out."""

from scaling.policy import ACTIONS, HOLD, Bounds, ControllerConfig, Decision, Signals, State, decide

__all__ = ["ACTIONS", "HOLD", "Bounds", "ControllerConfig", "Decision", "Signals", "State", "decide"]
