class BatchError(ValueError):
    """An invalid batch or item; raised before any session is changed."""


class NotNativeError(BatchError):
    """mode="native" asked for a batch the model's native path cannot take."""
