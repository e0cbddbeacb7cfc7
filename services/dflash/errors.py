"""The project's error types: every message names the problem and the fix."""


class DFlashError(Exception):
    """Base class for errors a user can act on; the CLI prints the message without a stack trace."""


class CheckpointError(DFlashError):
    """A model or drafter directory is missing, corrupt, or does not fit its partner."""


class IncompatibleDrafterError(CheckpointError):
    """The drafter's shapes, layer ids or vocabulary do not fit the target."""


class InvalidRequestError(DFlashError, ValueError):
    """A generation request has a bad field; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple:  # pickled as it was made (the engine process sends it to its replica)
        return type(self), (self.field, self.message)
