# Type stubs of the lossd package: the client from the extension, the errors from _errors.
from ._errors import (
    Aborted as Aborted, AlreadyExists as AlreadyExists, Cancelled as Cancelled,
    DataLoss as DataLoss, DeadlineExceeded as DeadlineExceeded, Error as Error,
    FailedPrecondition as FailedPrecondition, ForkedClient as ForkedClient, Internal as Internal,
    InvalidArgument as InvalidArgument, NotFound as NotFound, OutOfRange as OutOfRange,
    PermissionDenied as PermissionDenied, ResourceExhausted as ResourceExhausted,
    StatusCode as StatusCode, Unauthenticated as Unauthenticated, Unavailable as Unavailable,
    Unimplemented as Unimplemented, Unknown as Unknown)
from ._lossd import (
    LOSSD_SERVICE as LOSSD_SERVICE, BackwardResult as BackwardResult, Client as Client,
    EvaluateResult as EvaluateResult, ForwardResult as ForwardResult,
    LinearForwardResult as LinearForwardResult, ListResult as ListResult,
    PolicyStats as PolicyStats, ServerInfo as ServerInfo, TensorInfo as TensorInfo)

__version__: str
