#!/usr/bin/env python3
"""A straightforward lossd in Python (grpcio + torch.nn.functional.cross_entropy): the comparison
point of bench/service_bench.cc. Same wire API (lossd.v1) for the subset the benchmark workload
uses: Upload, Forward (in place: the logits handle becomes the gradient), Backward (records
grad_output), Download (applies it), Release, Describe, GetServerInfo. Forward also takes a
distillation with an inline top-k teacher (forward KL at temperature 1, either tail: what
bench/user_step.py's distillation step sends), written from docs/api.md's formulas in float32
torch with autograd for the gradient, as a user's own step would.

    python_server.py --stubs=BUILD/tests/reference/py --port_file=F [--device=cuda|cpu]
"""
import argparse
import os
import sys
import threading
import time
import uuid
from concurrent import futures


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stubs", required=True, help="folder with lossd/v1/lossd_pb2*.py")
    parser.add_argument("--port_file", required=True, help="written with the bound port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)

    import grpc
    import torch
    import torch.nn.functional as F
    from lossd.v1 import lossd_pb2 as pb
    from lossd.v1 import lossd_pb2_grpc as rpc

    device = torch.device(args.device)
    dtypes = {
        pb.DTYPE_FLOAT32: torch.float32,
        pb.DTYPE_BFLOAT16: torch.bfloat16,
        pb.DTYPE_FLOAT16: torch.float16,
        pb.DTYPE_INT32: torch.int32,
        pb.DTYPE_INT64: torch.int64,
    }
    reductions = {
        pb.REDUCTION_UNSPECIFIED: "mean",
        pb.REDUCTION_MEAN: "mean",
        pb.REDUCTION_SUM: "sum",
        pb.REDUCTION_NONE: "none",
    }

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def inline(tensor, k):
        return torch.frombuffer(bytearray(tensor.data), dtype=dtypes[tensor.dtype]).view(-1, k)

    def top_k_distillation(logits, targets, distillation, ignore_index, context):
        """(per-row alpha CE + (1 - alpha) KL(q || p), per-row KL, valid rows) against the
        inline top-k teacher: docs/api.md's buckets (the k classes, and with the BUCKET tail the
        rest as one more), in float32 on the whole [N, V] log-softmax."""
        top_k = distillation.teacher_top_k
        temperature = (distillation.temperature if distillation.HasField("temperature")
                       else 1.0)
        if (distillation.WhichOneof("teacher") != "teacher_top_k"
                or top_k.WhichOneof("indices") != "indices_inline"
                or top_k.WhichOneof("logprobs") != "logprobs_inline"
                or distillation.divergence not in (pb.DIVERGENCE_UNSPECIFIED,
                                                   pb.DIVERGENCE_FORWARD_KL)
                or temperature != 1.0):
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "the Python server distils forward KL at temperature 1 against an "
                          "inline top-k teacher only")
        indices = inline(top_k.indices_inline, top_k.k).to(device).long()
        log_q = inline(top_k.logprobs_inline, top_k.k).to(device)
        log_p = torch.log_softmax(logits.float(), -1)
        log_p_k = log_p.gather(1, indices)
        if top_k.tail == pb.TOP_K_TAIL_BUCKET:
            q_k = log_q.exp()
            q_tail = (1 - q_k.sum(-1)).clamp_min(0)
            p_tail = (1 - log_p_k.exp().sum(-1)).clamp_min(1e-30)
            tail = torch.where(q_tail > 0, q_tail * (q_tail.clamp_min(1e-30).log() - p_tail.log()),
                               torch.zeros_like(q_tail))
            kl = (q_k * (log_q - log_p_k)).sum(-1) + tail
        else:  # both sides renormalised over the k classes
            log_q = log_q - torch.logsumexp(log_q, -1, keepdim=True)
            log_p_k = log_p_k - torch.logsumexp(log_p_k, -1, keepdim=True)
            kl = (log_q.exp() * (log_q - log_p_k)).sum(-1)
        valid = targets != ignore_index
        ce = -log_p.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1)
        rows = distillation.alpha * ce + (1 - distillation.alpha) * kl
        return rows, kl, valid

    class Entry:
        def __init__(self, tensor, dtype):
            self.tensor = tensor
            self.dtype = dtype
            self.state = pb.TENSOR_STATE_LOGITS
            self.scale = 1.0  # grad_output recorded by Backward

    class Servicer(rpc.LossdServicer):
        def __init__(self):
            self.lock = threading.Lock()
            self.tensors = {}

        def info(self, handle, entry):
            t = entry.tensor
            return pb.TensorInfo(handle=handle, dtype=entry.dtype, shape=list(t.shape),
                                 bytes=t.numel() * t.element_size(), device=str(device),
                                 state=entry.state, pending_scale=entry.scale)

        def get(self, handle, context):
            with self.lock:
                entry = self.tensors.get(handle)
            if entry is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "unknown handle " + handle)
            return entry

        def add(self, tensor, dtype):
            handle = uuid.uuid4().hex
            entry = Entry(tensor, dtype)
            with self.lock:
                self.tensors[handle] = entry
            return handle, entry

        def Upload(self, request_iterator, context):
            header, data, at = None, None, 0
            for request in request_iterator:
                if request.WhichOneof("kind") == "header":
                    header = request.header
                    count = 1
                    for dim in header.shape:
                        count *= dim
                    data = bytearray(count * torch.empty(0, dtype=dtypes[header.dtype]).element_size())
                else:
                    if data is None or at + len(request.chunk) > len(data):
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad chunk")
                    data[at:at + len(request.chunk)] = request.chunk
                    at += len(request.chunk)
            if header is None or at != len(data):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "byte count differs from header")
            tensor = torch.frombuffer(data, dtype=dtypes[header.dtype]).view(*header.shape)
            tensor = tensor.to(device)
            sync()
            handle, entry = self.add(tensor, header.dtype)
            return pb.UploadResponse(tensor=self.info(handle, entry))

        def Forward(self, request, context):
            entry = self.get(request.logits, context)
            if entry.state != pb.TENSOR_STATE_LOGITS:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "logits were consumed")
            if request.WhichOneof("targets") == "targets_handle":
                targets = self.get(request.targets_handle, context).tensor
            else:
                inline = request.targets_inline
                targets = torch.frombuffer(bytearray(inline.data),
                                           dtype=dtypes[inline.dtype]).to(device)
            options = request.options
            ignore_index = options.ignore_index if options.HasField("ignore_index") else -100
            kwargs = dict(ignore_index=ignore_index, label_smoothing=options.label_smoothing,
                          reduction=reductions[options.reduction])
            start = time.perf_counter()
            mode = request.mode
            response = pb.ForwardResponse()
            targets = targets.long()

            def loss_of(logits):
                if not request.HasField("distillation"):
                    return F.cross_entropy(logits, targets, **kwargs)
                rows, kl, valid = top_k_distillation(logits, targets, request.distillation,
                                                     ignore_index, context)
                count = valid.sum().clamp_min(1)
                response.distillation_loss = float(kl[valid].sum() / count)
                if kwargs["reduction"] == "none":
                    return torch.where(valid, rows, torch.zeros_like(rows))
                total = rows[valid].sum()
                return total / count if kwargs["reduction"] == "mean" else total

            if mode == pb.GRADIENT_MODE_NONE:
                with torch.no_grad():
                    loss = loss_of(entry.tensor)
            else:
                logits = entry.tensor.detach().requires_grad_(True)
                loss = loss_of(logits)
                loss.backward(torch.ones_like(loss))
                gradient = logits.grad
                if mode == pb.GRADIENT_MODE_OUT_OF_PLACE:
                    handle, out = self.add(gradient, entry.dtype)
                    out.state = pb.TENSOR_STATE_GRADIENT
                    response.gradient = handle
                else:
                    # "In place": the handle now holds the gradient; the logits are dropped.
                    entry.tensor = gradient
                    entry.state = pb.TENSOR_STATE_GRADIENT
                    entry.scale = 1.0
                    response.gradient = request.logits
            sync()
            response.kernel_seconds = time.perf_counter() - start
            if loss.dim() == 0:
                response.loss = float(loss)
            else:
                response.loss = float(loss.float().sum())
            response.valid_tokens = int((targets != ignore_index).sum())
            return response

        def Backward(self, request, context):
            entry = self.get(request.gradient, context)
            if entry.state != pb.TENSOR_STATE_GRADIENT:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "holds logits")
            if request.WhichOneof("grad_output") != "scalar":
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "scalar grad_output only")
            entry.scale = request.scalar
            return pb.BackwardResponse(tensor=self.info(request.gradient, entry))

        def Download(self, request, context):
            entry = self.get(request.handle, context)
            tensor = entry.tensor
            if entry.scale != 1.0:
                tensor = tensor * entry.scale
            dtype = entry.dtype
            if request.dtype not in (pb.DTYPE_UNSPECIFIED, entry.dtype):
                tensor = tensor.to(dtypes[request.dtype])
                dtype = request.dtype
            data = tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy()
            header = self.info(request.handle, entry)
            header.dtype = dtype
            header.bytes = data.nbytes
            yield pb.DownloadResponse(header=header)
            chunk = request.chunk_bytes or (1 << 20)
            for at in range(0, data.nbytes, chunk):
                yield pb.DownloadResponse(chunk=data[at:at + chunk].tobytes())

        def Release(self, request, context):
            with self.lock:
                entry = self.tensors.pop(request.handle, None)
            if entry is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "unknown handle")
            return pb.ReleaseResponse(
                released_bytes=entry.tensor.numel() * entry.tensor.element_size())

        def Describe(self, request, context):
            return self.info(request.handle, self.get(request.handle, context))

        def GetServerInfo(self, request, context):
            return pb.ServerInfo(instance_id="python", device=str(device), version="python")

    limit = 64 << 20
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", limit),
                                  ("grpc.max_send_message_length", limit)])
    rpc.add_LossdServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("%s:0" % args.host)
    server.start()
    temporary = args.port_file + ".tmp"
    with open(temporary, "w") as f:
        f.write("%d\n" % port)
    os.replace(temporary, args.port_file)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
