"""Tessera's error hierarchy.

Every message names the cause and the next step; the CLI prints the message alone (no traceback
unless ``--debug``). This module imports nothing from Tessera, so every layer may raise these.
"""


class TesseraError(Exception):
    """Base of every error Tessera raises on purpose."""


class ConfigError(TesseraError):
    """A user-supplied value (strategy string, training config, preset name) is invalid."""


class ClusterSpecError(TesseraError):
    """A cluster preset or cluster file is malformed, unknown, or cannot hold the request."""


class ModelSpecError(TesseraError):
    """A model preset or model override is unknown or malformed."""


class CaptureError(TesseraError):
    """The model could not be traced or measured; the message names the module and op."""


class NotModelledError(TesseraError):
    """The strategy uses a parallelism the cost model or runtime does not implement yet."""


class InfeasiblePlanError(TesseraError):
    """No strategy fits in device memory; the message says by how much and which knob helps."""


class RuntimeSetupError(TesseraError):
    """The distributed world does not match the plan (world size, backend, devices)."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, incomplete (interrupted while written) or corrupt; the message names the file."""
