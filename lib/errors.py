"""The repository's errors: each says what to do; scripts print them as one line, without a traceback."""


class GPTliteError(RuntimeError):
    """An error with a message that says what to do; scripts print it without a traceback."""


class DataError(GPTliteError):
    pass


class CheckpointError(GPTliteError):
    pass


class TrainingDiverged(GPTliteError):
    """The loss became NaN or infinite: raised before anything is saved."""

