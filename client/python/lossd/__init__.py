"""lossd: the Python client of lossd, a GPU-resident cross-entropy service.

    import lossd
    client = lossd.Client("localhost:50051")
    handle = client.upload(logits).handle          # numpy [N, V], sent without a copy
    result = client.forward(handle, targets)       # loss; the gradient now sits in `handle`
    grad = client.download(handle)                 # numpy [N, V]
    client.release(handle)

lossd.Client wraps the C++ lossd::Client (data connections, stripes); every call releases the GIL
and raises a lossd.Error subclass per gRPC code. upload_async, forward_async, download_async,
evaluate_async, linear_forward_async and backward_async return concurrent.futures.Future objects.
``import lossd.torch`` for the PyTorch autograd function ``lossd.torch.cross_entropy``;
``from lossd.v1 import lossd_pb2, lossd_pb2_grpc`` for the raw gRPC stubs.
"""

from . import _errors, _futures
from ._errors import (
    Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error, FailedPrecondition,
    ForkedClient, Internal, InvalidArgument, NotFound, OutOfRange, PermissionDenied,
    ResourceExhausted, StatusCode, Unauthenticated, Unavailable, Unimplemented, Unknown)
from ._lossd import (
    LOSSD_SERVICE, BackwardResult, Client, EvaluateResult, ForwardResult, LinearForwardResult,
    ListResult, PolicyStats, ServerInfo, TensorInfo)
from ._version import __version__

for _name, _method in _futures.METHODS.items():
    setattr(Client, _name, _method)
del _name, _method

# Shown as lossd.X (help(), reprs, tracebacks) rather than the private modules defining them.
for _cls in (Client, TensorInfo, ServerInfo, ListResult, ForwardResult, LinearForwardResult,
             BackwardResult, EvaluateResult, PolicyStats, StatusCode, Error, ForkedClient,
             *_errors.ERRORS.values()):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "Client", "TensorInfo", "ServerInfo", "ListResult", "ForwardResult", "LinearForwardResult",
    "BackwardResult",
    "EvaluateResult", "PolicyStats", "LOSSD_SERVICE", "StatusCode", "Error", "Cancelled", "Unknown",
    "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal",
    "Unavailable", "DataLoss", "Unauthenticated", "ForkedClient", "__version__",
]
