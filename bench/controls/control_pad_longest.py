"""CONTROL (b), not tsbatch: what a careful engineer writes without tsbatch.

Like control (a), but each frontend batch is padded only to its longest input. First come first
served; any exception fails the whole batch.
"""
from control_pad_max import ControlPadToMaxLength


class ControlPadToLongest(ControlPadToMaxLength):
    padding = "longest"
