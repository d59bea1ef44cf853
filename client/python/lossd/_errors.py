"""The exceptions of lossd: one class per gRPC status code under lossd.Error, so that callers catch
what they can handle (``except lossd.NotFound``) and still see the server's code and message."""

import enum


class StatusCode(enum.IntEnum):
    """gRPC status codes (the same numbers as absl::StatusCode and grpc.StatusCode)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """A failed lossd call: ``.code`` (a StatusCode) and ``.message`` (the server's or client's
    text). Each code has its subclass; codes outside the table raise Error itself."""

    code = StatusCode.UNKNOWN

    def __init__(self, message="", code=None):
        super().__init__(message)
        if code is not None:
            self.code = StatusCode(code)
        self.message = message

    def __str__(self):
        return "%s: %s" % (self.code.name, self.message)


class Cancelled(Error):
    code = StatusCode.CANCELLED


class Unknown(Error):
    code = StatusCode.UNKNOWN


class InvalidArgument(Error, ValueError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error, TimeoutError):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFound(Error):
    code = StatusCode.NOT_FOUND


class AlreadyExists(Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDenied(Error):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    code = StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    code = StatusCode.ABORTED


class OutOfRange(Error):
    code = StatusCode.OUT_OF_RANGE


class Unimplemented(Error):
    code = StatusCode.UNIMPLEMENTED


class Internal(Error):
    code = StatusCode.INTERNAL


class Unavailable(Error):
    code = StatusCode.UNAVAILABLE


class DataLoss(Error):
    code = StatusCode.DATA_LOSS


class Unauthenticated(Error):
    code = StatusCode.UNAUTHENTICATED


class ForkedClient(FailedPrecondition, RuntimeError):
    """lossd after fork(): a call of a client the parent made, or a new client in a child forked
    after the parent's first client (gRPC's threads stayed in the parent, so either could wait
    forever). Raised at once instead; start such children with multiprocessing's "spawn" or
    "forkserver", or fork before the first client."""


ERRORS = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented,
    Internal, Unavailable, DataLoss, Unauthenticated)}


def error_from_code(code, message):
    """The exception for a status `code` (an int) and `message`; the bindings raise it."""
    try:
        code = StatusCode(code)
    except ValueError:
        return Error("%s (status code %d)" % (message, code), StatusCode.UNKNOWN)
    cls = ERRORS.get(code)
    return cls(message) if cls is not None else Error(message, code)
