class BatchError(ValueError):
    """An invalid batch or item; raised before any session is changed.

    ``item``: index of the offending item in the batch, or None when no single item is at fault
    (an empty batch, a bad mode).
    """

    def __init__(self, message: str, item=None):
        super().__init__(message)
        self.item = item


class NotNativeError(BatchError):
    """mode="native" asked for a batch the model's native path cannot take."""
