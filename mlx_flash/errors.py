class FlashError(Exception):
    """A user-facing error: one clear line, no traceback."""


class ModelFileError(FlashError):
    """A model file that could not be read as it should (a failed read, bytes that do not match
    their checksum): the model's fault, not the request's; a server reports itself damaged."""


class BudgetTooSmall(FlashError):
    """A weights budget that cannot hold what a plan needs: `needed` bytes against `budget`.
    Under --memory-limit the loader restates it in the limit's terms (the budget is the
    limit's share for weights, a number the user never gave)."""

    def __init__(self, message, budget, needed, reason, hint=""):
        super().__init__(message + hint)
        self.budget, self.needed, self.reason = budget, needed, reason
        self.hint = hint  # (", or ...": another way to fit, said after what the limit would need)
